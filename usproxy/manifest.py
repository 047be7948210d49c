"""Kubernetes manifests (YAML or JSON, multi-document, `List`) to Services and EndpointSlices.

Accepts what `kubectl get svc,endpointslices -A -o yaml` prints. A document that cannot be parsed
at all raises ConfigError (the caller decides: exit 2 at start-up, keep the last good state
later). A bad object inside a good document is recorded in `Manifests.errors` and skipped; every
other object is kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from usproxy.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.errors import ConfigError
from usproxy.fields import describe
from usproxy.service import Service, parse_service, skip_reason
from usproxy.types import NamespacedName

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass
class Manifests:
    """What one or more manifest files hold, keyed by namespace/name."""

    services: dict[NamespacedName, Service] = field(default_factory=dict)
    slices: dict[NamespacedName, EndpointSlice] = field(default_factory=dict)
    errors: list[ConfigError] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def merge(self, other: Manifests) -> None:
        self.services.update(other.services)
        self.slices.update(other.slices)
        self.errors.extend(other.errors)
        self.skipped.extend(other.skipped)


def parse_documents(text: str, source: str = "<input>") -> list[Mapping[str, Any]]:
    """Raw objects of a YAML/JSON text, `List` items flattened. Raises ConfigError."""
    try:
        docs = [json.loads(text)] if text.lstrip().startswith(("{", "[")) else list(yaml.safe_load_all(text))
    except (yaml.YAMLError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"cannot parse: {_first_line(err)}", obj=source) from None
    out: list[Mapping[str, Any]] = []
    for i, doc in enumerate(docs):
        out.extend(_flatten(doc, f"{source}: document {i}"))
    return out


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


def _flatten(doc: Any, where: str) -> Iterator[Mapping[str, Any]]:
    if doc is None:
        return
    if isinstance(doc, list):
        items: Any = doc
    elif isinstance(doc, Mapping) and doc.get("kind") == "List" or (
        isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List")
    ):
        items = doc.get("items") or []
    elif isinstance(doc, Mapping):
        yield doc
        return
    else:
        raise ConfigError(f"expected an object, got {type(doc).__name__}", obj=where)
    if not isinstance(items, list):
        raise ConfigError("must be a list", obj=where, field="items")
    for j, item in enumerate(items):
        yield from _flatten(item, f"{where} item {j}")


def objects_from(raws: list[Mapping[str, Any]]) -> Manifests:
    """Parse raw objects; bad ones go to `errors`, skipped Services to `skipped`."""
    out = Manifests()
    for raw in raws:
        kind = raw.get("kind")
        try:
            if kind == "Service":
                _add_service(raw, out)
            elif kind == "EndpointSlice":
                es = parse_endpoint_slice(raw)
                out.slices[es.name] = es
            else:
                log.debug("ignoring %s", describe(str(kind), raw))
        except ConfigError as err:
            out.errors.append(err)
        except (TypeError, ValueError, AttributeError) as err:  # shapes Fields did not foresee
            out.errors.append(ConfigError(f"malformed: {_first_line(err)}", obj=describe(str(kind), raw)))
    return out


def _add_service(raw: Mapping[str, Any], out: Manifests) -> None:
    why = skip_reason(raw)
    if why is not None:
        out.skipped.append(f"{describe('Service', raw)}: {why}")
        return
    svc = parse_service(raw)
    out.services[svc.name] = svc


def manifest_files(path: Path) -> list[Path]:
    """The manifest files of a path: the file itself, or a directory's *.yaml/*.yml/*.json."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in MANIFEST_SUFFIXES and p.is_file()
                      and not any(part.startswith(".") for part in p.relative_to(path).parts))
    return [path]


def load_file(path: Path) -> Manifests:
    """Parse one file. Raises ConfigError when the file cannot be read or parsed at all."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read: {err}", obj=str(path)) from None
    return objects_from(parse_documents(text, str(path)))
