"""Typed access to raw API bodies with errors that name the object and the field.

Every getter raises ConfigError("<Kind> <ns>/<name>: <path>: <problem>"), so a bad document is
reported exactly and can be skipped without affecting any other object.

Names are validated as the API server does (k8s.io/apimachinery/pkg/util/validation: IsDNS1123Label,
IsDNS1123Subdomain), because they end up in kernel commands (nftables element comments) and log
lines: a name outside those alphabets (a quote, a newline) is refused here. `describe()` quotes
a name that is not safe, so the error about it cannot forge a log line either.

Repeated strings are shared, not copied: a label (namespace, Service and port names) is interned,
and `choice` returns the allowed value itself, so 10,000 Services in one namespace keep one
"default" and one "ClusterIP", not 10,000 each (a decoded body gives every occurrence its own
string: at 10,000 Services, ~100,000 strings and 6 MiB).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from usproxy.util.errors import ConfigError
from usproxy.model.types import IPAddress, parse_ip_sloppy

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(_LABEL)  # at most 63 characters
DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")  # at most 253 characters
_LABEL_HELP = "lower-case letters, digits and '-', starting and ending with a letter or digit"


def is_dns1123_label(text: str) -> bool:
    """IsDNS1123Label: what namespace names, Service names and port names are."""
    return len(text) <= 63 and DNS1123_LABEL.fullmatch(text) is not None


def is_dns1123_subdomain(text: str) -> bool:
    """IsDNS1123Subdomain: what most object names (EndpointSlice names) are."""
    return len(text) <= 253 and DNS1123_SUBDOMAIN.fullmatch(text) is not None


class Fields:
    """A cursor into one raw object: `obj` names it, `path` is where we are inside it."""

    __slots__ = ("obj", "path", "data")

    def __init__(self, obj: str, data: Mapping[str, Any], path: str = "") -> None:
        self.obj = obj
        self.path = path
        self.data = data

    def _at(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | int, message: str) -> ConfigError:
        return ConfigError(message, obj=self.obj, field=self._at(key))

    def child(self, key: str, *, required: bool = False) -> Fields:
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "required")
            value = {}
        if not isinstance(value, Mapping):
            raise self.error(key, f"must be an object, got {type(value).__name__}")
        return Fields(self.obj, value, self._at(key))

    def items(self, key: str, most: int | None = None) -> list[Fields]:
        """The elements of a list of objects (missing or null means empty); more than `most`
        elements is an error before any element is looked at (field.TooMany)."""
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        if most is not None and len(value) > most:
            raise self.error(key, f"must have at most {most} items, got {len(value)}")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                raise Fields(self.obj, {}, self._at(key)).error(i, "must be an object")
            out.append(Fields(self.obj, item, f"{self._at(key)}[{i}]"))
        return out

    def text(self, key: str, default: str | None = None) -> str:
        value = self.data.get(key, default)
        if value is None:
            raise self.error(key, "required")
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        return value

    def label(self, key: str, default: str | None = None) -> str:
        """A DNS-1123 label (namespace, Service and port names); "" only when `default` is ""
        (an unnamed port). Raises ConfigError."""
        value = self.text(key, default)
        if not (value == default == "" or is_dns1123_label(value)):
            raise self.error(key, f"must be a DNS-1123 label ({_LABEL_HELP}, at most 63), got {value!r}")
        return sys.intern(value)

    def subdomain(self, key: str, default: str | None = None) -> str:
        """A DNS-1123 subdomain (object names such as an EndpointSlice's). Raises ConfigError."""
        value = self.text(key, default)
        if not is_dns1123_subdomain(value):
            raise self.error(key, f"must be a DNS-1123 subdomain ({_LABEL_HELP}, "
                                  f"dot-separated, at most 253), got {value!r}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None:
            return None
        return self.text(key)

    def str_list(self, key: str) -> list[str]:
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        return list(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.error(key, "must be a map of strings")
        return {str(k): str(v) for k, v in value.items()}

    def integer(self, key: str, default: int | None = None, *, lo: int = 0, hi: int = 65535) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self.error(key, "required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise self.error(key, f"must be between {lo} and {hi}, got {value}")
        return value

    def opt_bool(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self.error(key, f"must be true or false, got {value!r}")

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.data.get(key)
        if value is None or value == "":
            return default
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return choices[choices.index(value)]

    def ip(self, key: str | int, text: object) -> IPAddress:
        if not isinstance(text, str):
            raise self.error(key, f"must be an IP address, got {text!r}")
        try:
            return parse_ip_sloppy(text)  # leading zeros as kube-proxy (ParseIPSloppy)
        except ValueError:
            raise self.error(key, f"not a valid IP address: {text!r}") from None


def describe(kind: str, raw: Mapping[str, Any]) -> str:
    """"Service default/web" for error messages, tolerant of broken metadata. A namespace or
    name that is not a DNS-1123 subdomain is shown quoted (repr), so it cannot forge log lines."""
    meta = raw.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    ns, name = meta.get("namespace") or "default", meta.get("name", "<unnamed>")
    return f"{kind} {_shown(ns)}/{_shown(name)}"


def _shown(value: object) -> str:
    if isinstance(value, str) and (value == "<unnamed>" or is_dns1123_subdomain(value)):
        return value
    return repr(value)
