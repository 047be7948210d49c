"""Kubernetes manifests (YAML or JSON, multi-document, `List`) to Services, EndpointSlices,
ServiceCIDRs and Nodes (their spec.podCIDRs, for detectLocalMode NodeCIDR).

Accepts what `kubectl get svc,endpointslices -A -o yaml` prints. A document that cannot be parsed
at all raises ConfigError (the caller decides: exit 2 at start-up, keep the last good state
later). A bad object inside a good document is recorded in `Manifests.errors` and skipped; every
other object is kept. Objects of other kinds (`kubectl get all` prints Pods, Deployments...) are
ignored, but an object without a kind, or whose kind looks like a misspelt one usproxy reads
(`Servce`, `service`), is an error naming it, the field `kind` and the kinds expected. A file or directory that cannot be read (EMFILE, EACCES, EIO...) raises
ManifestReadError, never an empty result: a local read error must not read as "no objects" (which
would withdraw every Service), so only a path that does not exist lists as nothing.
"""

from __future__ import annotations

import difflib
import errno
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from usproxy.model.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.util.errors import ConfigError
from usproxy.model.fields import describe
from usproxy.model.node import NodePodCIDRs, parse_node_pod_cidrs
from usproxy.model.service import Service, parse_service, skip_reason
from usproxy.model.service_cidr import SERVICE_CIDR_KIND, ServiceCIDR, parse_service_cidr
from usproxy.model.types import NamespacedName

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
VANISHED = frozenset({errno.ENOENT, errno.ENOTDIR})  # a directory removed while it is walked


class ManifestReadError(ConfigError):
    """A manifest file or directory exists but could not be read; `errno` is the OS's (0 when
    unknown). Transient by nature (descriptors, permissions, I/O): the caller keeps its last good
    state and tries again."""

    def __init__(self, err: OSError, path: str) -> None:
        self.errno = err.errno or 0
        name = errno.errorcode.get(self.errno, str(self.errno))
        super().__init__(f"cannot read: [{name}] {err.strerror or err}", obj=str(err.filename or path))


@dataclass
class Manifests:
    """What one or more manifest files hold, keyed by namespace/name."""

    services: dict[NamespacedName, Service] = field(default_factory=dict)
    slices: dict[NamespacedName, EndpointSlice] = field(default_factory=dict)
    service_cidrs: dict[str, ServiceCIDR] = field(default_factory=dict)  # by name (cluster-scoped)
    nodes: dict[str, NodePodCIDRs] = field(default_factory=dict)  # by name (cluster-scoped)
    errors: list[ConfigError] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def merge(self, other: Manifests) -> None:
        self.services.update(other.services)
        self.slices.update(other.slices)
        self.service_cidrs.update(other.service_cidrs)
        self.nodes.update(other.nodes)
        self.errors.extend(other.errors)
        self.skipped.extend(other.skipped)


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: ~10x


MAX_ALIAS_EXPANSION = 1_000_000  # nodes a document may expand to through aliases


class _BoundedAliasLoader(_BaseLoader):  # type: ignore[misc]
    """Safe YAML whose aliases stay harmless: kubectl never writes anchors, but YAML emitters
    (PyYAML's among them) do for repeated objects, so aliases are allowed while a document
    neither refers to itself nor expands through them to more than MAX_ALIAS_EXPANSION nodes
    (a "billion laughs" document of a few hundred bytes)."""

    def construct_document(self, node: Any) -> Any:
        distinct: dict[int, int] = {}
        if _expanded_size(node, distinct, set()) > max(MAX_ALIAS_EXPANSION, 10 * len(distinct)):
            raise yaml.constructor.ConstructorError(
                None, None, f"YAML aliases expand to more than {MAX_ALIAS_EXPANSION} nodes", node.start_mark)
        return super().construct_document(node)

    def construct_scalar(self, node: Any) -> Any:
        # A fresh copy: the composer's string, kept in the result, would pin the allocator's
        # arenas of the node tree (~10x the text) after the tree is freed (an agent with 100
        # bench Services kept 3 MiB more RSS). surrogatepass: a "\ud800" escape is valid YAML.
        value = super().construct_scalar(node)
        if isinstance(value, str):
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
        return value


def _expanded_size(node: Any, memo: dict[int, int], stack: set[int]) -> int:
    """Nodes `node` stands for once every alias is expanded; raises on a self-reference."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in stack:
        raise yaml.constructor.ConstructorError(None, None, "a YAML alias refers to itself", node.start_mark)
    stack.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo, stack) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo, stack) + _expanded_size(v, memo, stack) for k, v in node.value)
    stack.discard(key)
    memo[key] = size
    return size


def _load_yaml(text: str) -> list[Any]:
    loader = _BoundedAliasLoader(text)
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()


def parse_documents(text: str, source: str = "<input>") -> list[Mapping[str, Any]]:
    """Raw objects of a YAML/JSON text, `List` items flattened. Raises ConfigError.

    Text that starts with `{` or `[` is tried as JSON first and as (flow-style) YAML after."""
    try:
        docs = _parse(text)
    except (yaml.YAMLError, json.JSONDecodeError, RecursionError, ValueError) as err:
        raise ConfigError(f"cannot parse{_position(err)}: {_problem(err)}", obj=source) from None
    out: list[Mapping[str, Any]] = []
    for i, doc in enumerate(docs):
        out.extend(_flatten(doc, f"{source}: document {i}"))
    return out


def _parse(text: str) -> list[Any]:
    if text.lstrip().startswith(("{", "[")):
        try:
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass
    return _load_yaml(text)


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


def _position(err: BaseException) -> str:
    """" at line L, column C" (1-based) of a YAML or JSON parse error, or "" when it has none."""
    if isinstance(err, json.JSONDecodeError):
        return f" at line {err.lineno}, column {err.colno}"
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if mark is None:
        return ""
    return f" at line {mark.line + 1}, column {mark.column + 1}"


def _problem(err: BaseException) -> str:
    """The parser's complaint without PyYAML's `in "<unicode string>"` marks (the file is named
    by the caller, the position by _position)."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem:
        started = err.context_mark
        at = f" started at line {started.line + 1}, column {started.column + 1}" if started else ""
        context = f" ({err.context}{at})" if err.context else ""
        return _first_line(ValueError(f"{err.problem}{context}"))
    if isinstance(err, json.JSONDecodeError):
        return err.msg
    return _first_line(err)


def _flatten(doc: Any, where: str) -> Iterator[Mapping[str, Any]]:
    """A document is an object, a `List` (or `*List`) of objects, or a plain list of objects;
    lists do not nest further."""
    if doc is None:
        return
    if isinstance(doc, Mapping) and not str(doc.get("kind", "")).endswith("List"):
        yield doc
        return
    items = doc.get("items") or [] if isinstance(doc, Mapping) else doc
    if not isinstance(items, list):
        raise ConfigError(f"expected an object or a List, got {type(items).__name__}", obj=where,
                          field="items" if isinstance(doc, Mapping) else "")
    for j, item in enumerate(items):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise ConfigError(f"expected an object, got {type(item).__name__}", obj=f"{where} item {j}")
        yield item


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
            elif kind == SERVICE_CIDR_KIND:
                sc = parse_service_cidr(raw)
                out.service_cidrs[sc.name] = sc
            elif kind == "Node":
                node = parse_node_pod_cidrs(raw)
                out.nodes[node.name] = node
            else:
                _other_kind(kind, raw)
        except ConfigError as err:
            out.errors.append(err)
        except (TypeError, ValueError, AttributeError) as err:  # shapes Fields did not foresee
            out.errors.append(ConfigError(f"malformed: {_first_line(err)}", obj=describe(str(kind), raw)))
    return out


READ_KINDS = ("Service", "EndpointSlice", SERVICE_CIDR_KIND, "Node")


def _other_kind(kind: object, raw: Mapping[str, Any]) -> None:
    """An object of a kind usproxy does not read: ignored, unless it has no kind or its kind is
    close to one usproxy reads (a typo would otherwise drop a Service in silence): ConfigError."""
    expected = f"expected one of {', '.join(READ_KINDS)} (other kinds are ignored)"
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"required: {expected}, got {kind!r}", obj=describe("object", raw), field="kind")
    near = difflib.get_close_matches(kind, READ_KINDS, n=1, cutoff=0.75) or \
        [k for k in READ_KINDS if k.lower() == kind.lower()]
    if near:
        raise ConfigError(f"{expected}, got {kind!r}: did you mean {near[0]}?", obj=describe(repr(kind), raw),
                          field="kind")
    log.debug("ignoring %s", describe(kind, raw))


def _add_service(raw: Mapping[str, Any], out: Manifests) -> None:
    why = skip_reason(raw)
    if why is not None:
        out.skipped.append(f"{describe('Service', raw)}: {why}")
        return
    svc = parse_service(raw)
    out.services[svc.name] = svc


def manifest_files(path: Path) -> list[Path]:
    """The manifest files of a path: the file itself, or a directory's *.yaml/*.yml/*.json.

    Hidden files and directories are skipped and not walked (a kubelet ConfigMap volume keeps
    its data in `..<timestamp>` directories, replaced atomically); a directory that vanishes while
    it is walked is ignored. Raises ManifestReadError when a directory cannot be listed (EMFILE,
    EACCES...): a partial listing would withdraw the objects of every file it missed."""
    if not path.is_dir():
        return [path]
    out: list[Path] = []
    try:
        for root, dirs, files in os.walk(path, onerror=_unless_vanished):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            out.extend(Path(root, f) for f in files if not f.startswith(".") and f.endswith(MANIFEST_SUFFIXES))
        return sorted(p for p in out if p.is_file())
    except OSError as err:
        raise ManifestReadError(err, str(path)) from None


def _unless_vanished(err: OSError) -> None:
    if err.errno not in VANISHED:
        raise err


def load_file(path: Path) -> Manifests:
    """Parse one file. Raises ManifestReadError when it cannot be read, ConfigError when it is not
    UTF-8 or cannot be parsed at all."""
    return objects_from(parse_documents(read_text(path), str(path)))


def read_text(path: Path) -> str:
    """A manifest file's text. Raises ManifestReadError (OS error) or ConfigError (not UTF-8)."""
    try:
        return path.read_text()
    except OSError as err:
        raise ManifestReadError(err, str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read: {err}", obj=str(path)) from None
