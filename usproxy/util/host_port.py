"""HOST:PORT as a flag gives it: the address the agent serves /healthz and /metrics at (`run`'s
--healthz-bind-address, --metrics-bind-address) and the one `status`, `flows` and `explain --live`
dial. One reading for all of them, so that an address one command takes the other does too."""

from __future__ import annotations

import ipaddress
import re

_HOST_NAME = re.compile(r"[A-Za-z0-9.-]+")  # a DNS name or an IPv4 literal
_DOTTED_DIGITS = re.compile(r"[0-9.]+")
EXPECTED = "expected HOST:PORT (a name, an IPv4 address or [an IPv6 address], and a port)"


def split(text: str, *, empty_host: str | None = None) -> tuple[str, int]:
    """"host:port" or "[v6]:port" → (host, port), PORT 0-65535. An empty HOST is `empty_host` where
    one is given (a bind address's "all addresses"), else refused. ValueError says what was
    expected and what was given."""
    host, sep, port = text.rpartition(":")
    host = host or empty_host or ""
    if not sep or not (port.isascii() and port.isdigit()) or int(port) > 65535 or not _host_ok(host):
        raise ValueError(f"{EXPECTED}, got {text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if _DOTTED_DIGITS.fullmatch(host):  # 300.1.1.1 is a bad address, not a name to look up
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
    return _HOST_NAME.fullmatch(host) is not None


def bind_address(text: str) -> tuple[str, int]:
    """A listener's HOST:PORT: an empty HOST is every IPv4 address (":10256" → 0.0.0.0)."""
    return split(text, empty_host="0.0.0.0")
