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

Texts are cut into documents and List items (manifest_pieces.py) and each piece is read by
BlockYaml (block_yaml.py: kubectl's block style, line by line) or, where it does not take the
piece, by PyYAML's C loader; a text whose cut does not hold is parsed whole by PyYAML, which also
gives every parse error its line and column. ManifestParser keeps a file's pieces, so a rewritten
file is parsed again only where its text changed.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from usproxy.model import block_yaml
from usproxy.model.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.model.manifest_layout import Layout, window_items
from usproxy.model.manifest_pieces import DocumentCut, cut
from usproxy.util.errors import ConfigError
from usproxy.util.gc_pause import gc_paused, promote_survivors
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
    with gc_paused(True):
        pieces = _read_pieces(text)
        if pieces is not None:
            return [raw for key, value, where, _ in pieces for raw in _raws(value, key[:1] == b"i", _where(source, where))]
        return _parse_whole(text, source)


def _parse_whole(text: str, source: str) -> list[Mapping[str, Any]]:
    """parse_documents for a text that is not cut into pieces: one parse of the whole text."""
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


Entry = tuple[str, Any, Any]  # (what, key, value): what one raw object adds to a Manifests


def objects_from(raws: list[Mapping[str, Any]]) -> Manifests:
    """Parse raw objects; bad ones go to `errors`, skipped Services to `skipped`."""
    out = Manifests()
    for raw in raws:
        entry = _entry(raw)
        if entry is not None:
            _take(out, entry)
    return out


def _entry(raw: Mapping[str, Any]) -> Entry | None:
    """What one raw object adds: a parsed object by name, an error or a skipped Service's note
    (None for kinds that are not read)."""
    kind = raw.get("kind")
    try:
        if kind == "Service":
            why = skip_reason(raw)
            if why is not None:
                return ("skipped", None, f"{describe('Service', raw)}: {why}")
            svc = parse_service(raw)
            return ("service", svc.name, svc)
        if kind == "EndpointSlice":
            es = parse_endpoint_slice(raw)
            return ("slice", es.name, es)
        if kind == SERVICE_CIDR_KIND:
            sc = parse_service_cidr(raw)
            return ("cidr", sc.name, sc)
        if kind == "Node":
            node = parse_node_pod_cidrs(raw)
            return ("node", node.name, node)
        _other_kind(kind, raw)
        return None
    except ConfigError as err:
        return ("error", None, err)
    except (TypeError, ValueError, AttributeError) as err:  # shapes Fields did not foresee
        return ("error", None, ConfigError(f"malformed: {_first_line(err)}", obj=describe(str(kind), raw)))


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


def _take(out: Manifests, entry: Entry) -> None:
    what, key, value = entry
    if what == "service":
        out.services[key] = value
    elif what == "slice":
        out.slices[key] = value
    elif what == "cidr":
        out.service_cidrs[key] = value
    elif what == "node":
        out.nodes[key] = value
    elif what == "error":
        out.errors.append(value)
    else:
        out.skipped.append(value)


class _Whole(Exception):
    """The cut of a text did not hold (a piece is not YAML alone): parse the whole text."""


PieceKey = bytes  # b"i" (an item of a List) or b"d" (a whole document), then a digest of its text
Where = tuple[int, int]  # (document, item; -1: the whole document), for errors


class _Digests:
    """128-bit digests of the pieces of one text (the cache's keys: 10,000 Services' pieces
    would hold 7 MiB as texts), taken from the encoded text without copying each piece."""

    def __init__(self, text: str, data: bytes | None = None) -> None:
        self.text = text
        if data is None and text.isascii():
            data = text.encode("ascii")
        self.data = memoryview(data) if data is not None else None  # ASCII: offsets = indices

    def key(self, item: bool, a: int, b: int) -> PieceKey:
        chunk = self.data[a:b] if self.data is not None else self.text[a:b].encode("utf-8", "surrogatepass")
        return (b"i" if item else b"d") + hashlib.blake2b(chunk, digest_size=16).digest()


class PieceHelper(Protocol):
    """Another process parsing the pieces of the same text that start at or after `start`
    (sources/parse_helper.py): `result()` waits for their entries by piece key (`parse_share`),
    None when it delivers none."""

    start: int

    def result(self) -> Mapping[PieceKey, Packed] | None: ...


class ManifestParser:
    """Parses the successive texts of one manifest file. The text is cut into pieces
    (manifest_pieces.py: documents and List items); a piece is read by BlockYaml, or by PyYAML
    when BlockYaml does not take it, and the objects it yields are kept until the next text, so
    a rewritten file costs the pieces that changed. Same results and errors as
    `objects_from(parse_documents(text))`, which is what runs whenever the cut does not hold."""

    def __init__(self) -> None:
        self._pieces: dict[PieceKey, Packed] = {}
        # of the last text, for the next one's diff (manifest_layout.py): its layout, each
        # piece's entries in order, the result, and whether a name was defined twice in it
        self._layout: Layout | None = None
        self._order: list[Packed] = []
        self._last: Manifests | None = None
        self._repeated = False

    def parse_bytes(self, data: bytes, source: str = "<input>") -> Manifests:
        """`parse` of a file's bytes, decoded as Path.read_text() decodes them. When the last
        text was cut and this one is ASCII with LF line ends, only the window that holds its
        changes is cut and digested again (manifest_layout.py: a one-line edit of 9.6 MB costs
        ~15 ms instead of ~90). Raises ConfigError."""
        plain = data.isascii() and b"\r" not in data
        if plain and self._layout is not None:
            with gc_paused(True):
                out = self._rewrite(data, source)
                if out is not None:
                    promote_survivors()
                    return out
        return self.parse(decode(data, source), source, data=data if plain else None)

    def parse(self, text: str, source: str = "<input>", helper: PieceHelper | None = None,
              data: bytes | None = None) -> Manifests:
        """Raises ConfigError when the text cannot be parsed at all. With `helper`, the pieces
        from `helper.start` on are taken from it (those it does not deliver are parsed here).
        `data`: the text's own bytes when it is ASCII with LF line ends (its layout is kept)."""
        with gc_paused(True):  # a burst of acyclic objects: nothing for the collector to find
            start = helper.start if helper is not None else -1
            pieces = _read_pieces(text, self._pieces, (lambda a: a < start) if helper is not None else None,
                                  data=data)
            if pieces is None:
                out = objects_from(parse_documents(text, source))
                self._pieces, self._layout, self._order, self._last = {}, None, [], None
                return out
            kept: dict[PieceKey, Packed] = {}
            order: list[tuple[Entry, ...]] = []
            packs: list[Packed] = []
            shared: Mapping[PieceKey, Packed] | None = None
            for key, value, where, span in pieces:
                packed = kept.get(key)
                if packed is None:
                    packed = self._pieces.get(key)
                if packed is None and value is _DEFERRED:
                    if shared is None:
                        shared = (helper.result() if helper is not None else None) or {}
                    packed = shared.get(key)
                    if packed is None:  # not delivered: parsed here
                        try:
                            value = _piece_value(text, span, key[:1] == b"i", {})
                        except _Whole:
                            return objects_from(parse_documents(text, source))
                if packed is None:
                    packed = _entries_of(key, value, source, where)
                kept[key] = packed
                packs.append(packed)
                order.append(_unpack(packed))
            self._pieces = kept
            out = self._remember(_manifests([e for entries in order for e in entries]), packs)
            self._layout = Layout.of(data, [(key, span, where) for key, _, where, span in pieces]) \
                if data is not None else None
            promote_survivors()  # unscanned into the oldest generation: no collection walks them now
            return out

    def _remember(self, out: Manifests, packs: list[Packed]) -> Manifests:
        self._order, self._last = packs, out
        named = sum(1 for p in packs for what, _, _ in _unpack(p) if what in ("service", "slice", "cidr", "node"))
        self._repeated = named != len(out.services) + len(out.slices) + len(out.service_cidrs) + len(out.nodes)
        return out

    def _rewrite(self, data: bytes, source: str) -> Manifests | None:
        """The next version of the last text, parsed where it changed; None when its changes
        are not within the items of one document (then it is cut whole)."""
        layout, last = self._layout, self._last
        assert layout is not None and last is not None
        w = layout.window(data)
        if w is None:
            return last if layout.unchanged(data) else None
        text = data[w.start:w.end].decode("ascii")
        spans = window_items(text, w.start)
        if spans is None:
            return None
        doc, item0 = layout.docs[w.first], layout.items[w.first]
        memo: dict[str, Any] = {}
        keys: list[PieceKey] = []
        packs: list[Packed] = []
        for k, (a, b) in enumerate(spans):
            key = b"i" + hashlib.blake2b(memoryview(data)[a:b], digest_size=16).digest()
            packed = self._pieces.get(key)
            if packed is None:
                try:
                    value = _piece_value(text, (a - w.start, b - w.start), True, memo)
                except _Whole:
                    return None
                packed = _entries_of(key, value, source, (doc, item0 + k))
            keys.append(key)
            packs.append(packed)
        order = self._order[:w.first] + packs + self._order[w.last + 1:]
        out = self._patched(w.first, w.last, packs)
        if out is None:
            out = _manifests([e for p in order for e in _unpack(p)])
        gone = set(layout.keys[w.first:w.last + 1]).difference(keys)
        for key in gone:
            self._pieces.pop(key, None)
        self._pieces.update(zip(keys, packs))
        self._layout = layout.replace(data, w, keys, spans)
        return self._remember(out, order) if out is not last else out

    def _patched(self, first: int, last: int, packs: list[Packed]) -> Manifests | None:
        """The last result with the entries of pieces first..last replaced by those of `packs`,
        when every one of them is a Service or an EndpointSlice whose name no other piece
        defines; None otherwise (the result is then built again from every piece)."""
        if self._repeated or self._last is None:
            return None
        old = [e for p in self._order[first:last + 1] for e in _unpack(p)]
        new = [e for p in packs for e in _unpack(p)]
        if any(what not in ("service", "slice") for what, _, _ in old + new):
            return None
        prev = self._last
        services, slices = dict(prev.services), dict(prev.slices)
        for what, key, _ in old:
            del (services if what == "service" else slices)[key]
        for what, key, value in new:
            into = services if what == "service" else slices
            if key in into:
                return None
            into[key] = value
        return Manifests(services, slices, dict(prev.service_cidrs), dict(prev.nodes), list(prev.errors),
                         list(prev.skipped))


def parse_share(text: str, start: int, source: str = "<input>") -> list[tuple[PieceKey, Packed]] | None:
    """The entries of each piece of `text` that starts at or after `start`, by piece key: a
    PieceHelper's part of ManifestParser.parse (same keys, values and errors). None when the text
    is not cut, its cut does not hold, or a piece cannot be parsed alone."""
    with gc_paused(True):
        try:
            pieces = _read_pieces(text, None, lambda a: a >= start, only_mine=True)
            if pieces is None:
                return None
            return [(key, _entries_of(key, value, source, where)) for key, value, where, _ in pieces
                    if value is not _DEFERRED]
        except ConfigError:  # the parser reports it, parsing the piece itself
            return None


def _entries_of(key: PieceKey, value: Any, source: str, where: Where) -> Packed:
    """What one parsed piece adds, packed. Raises ConfigError (a List item that is no object)."""
    return _pack(tuple(e for raw in _raws(value, key[:1] == b"i", _where(source, where)) if (e := _entry(raw)) is not None))


Packed = Service | EndpointSlice | tuple[Entry, ...]  # a piece's entries as the parser keeps them


def _pack(entries: tuple[Entry, ...]) -> Packed:
    """A piece's entries, kept small: the one Service or EndpointSlice most pieces yield stands
    for its entry (10,000 Services: 2.4 MiB less)."""
    if len(entries) == 1:
        what, key, value = entries[0]
        if what in ("service", "slice") and isinstance(value, (Service, EndpointSlice)) and value.name == key:
            return value
    return entries


def _unpack(packed: Packed) -> tuple[Entry, ...]:
    if isinstance(packed, Service):
        return (("service", packed.name, packed),)
    if isinstance(packed, EndpointSlice):
        return (("slice", packed.name, packed),)
    return packed


def _manifests(entries: list[Entry]) -> Manifests:
    """The Manifests of `entries` in order (a later object of the same name wins, as _take)."""
    return Manifests(services={k: v for what, k, v in entries if what == "service"},
                     slices={k: v for what, k, v in entries if what == "slice"},
                     service_cidrs={k: v for what, k, v in entries if what == "cidr"},
                     nodes={k: v for what, k, v in entries if what == "node"},
                     errors=[v for what, _, v in entries if what == "error"],
                     skipped=[v for what, _, v in entries if what == "skipped"])


def _where(source: str, where: Where) -> str:
    doc, item = where
    return f"{source}: document {doc}" + (f" item {item}" if item >= 0 else "")


_CACHED = object()  # a piece whose value was not read again: its entries are kept
_DEFERRED = object()  # a piece left to another process (ManifestParser.parse's helper)
Piece = tuple[PieceKey, Any, Where, tuple[int, int]]  # key, value (or _CACHED, _DEFERRED), where, span


def _read_pieces(text: str, cache: Mapping[PieceKey, object] | None = None,
                 mine: Callable[[int], bool] | None = None, only_mine: bool = False,
                 data: bytes | None = None) -> list[Piece] | None:
    """Each piece of `text` with its YAML value (_CACHED when `cache` holds its key, _DEFERRED
    when `mine` is given and says no to its start; left out then with `only_mine`), where it is
    (for errors) and its span; None when the text is not cut, or its cut did not hold."""
    cuts = cut(text)
    if cuts is None:
        return None
    memo: dict[str, Any] = {}  # line shapes, shared by the pieces of this text
    digests = _Digests(text, data)
    out: list[Piece] = []
    try:
        for doc in cuts:
            _document_pieces(doc, text, digests, memo, cache or {}, mine, only_mine, out)
    except _Whole:
        return None
    return out


def _document_pieces(doc: DocumentCut, text: str, digests: _Digests, memo: dict[str, Any],
                     cache: Mapping[PieceKey, object], mine: Callable[[int], bool] | None, only_mine: bool,
                     out: list[Piece]) -> None:
    i = doc.index
    if doc.items is not None and (doc.skeleton is None or _is_list_skeleton(_load_piece(doc.skeleton, memo))):
        key_of = digests.key
        for j, span in enumerate(doc.item_spans()):
            if only_mine and mine is not None and not mine(span[0]):
                continue
            key = key_of(True, *span)
            value: Any = _CACHED
            if key not in cache:
                value = _piece_value(text, span, True, memo) if mine is None or mine(span[0]) else _DEFERRED
            out.append((key, value, (i, j), span))
        return
    span = doc.span
    if only_mine and mine is not None and not mine(span[0]):
        return
    key = digests.key(False, *span)
    value = _CACHED
    if key not in cache:
        value = _piece_value(text, span, False, memo) if mine is None or mine(span[0]) else _DEFERRED
    out.append((key, value, (i, -1), span))


def _piece_value(text: str, span: tuple[int, int], item: bool, memo: dict[str, Any]) -> Any:
    """The YAML value of the piece at `span`. Raises _Whole when it cannot be read alone, or an
    item does not read as a sequence of one entry (the cut was not at entries)."""
    value = _load_piece(text[span[0]:span[1]], memo)
    if item and not (isinstance(value, list) and len(value) == 1):
        raise _Whole
    return value


def _is_list_skeleton(value: Any) -> bool:
    return isinstance(value, Mapping) and str(value.get("kind", "")).endswith("List") and value.get("items") is None


def _load_piece(text: str, memo: dict[str, Any]) -> Any:
    """One piece's YAML value. Raises _Whole when PyYAML cannot read the piece alone."""
    try:
        return block_yaml.load(text, memo)
    except block_yaml.Unsupported:
        pass
    try:
        docs = _load_yaml(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        raise _Whole from None
    if len(docs) > 1:
        raise _Whole
    return docs[0] if docs else None


def _raws(value: Any, item: bool, where: str) -> list[Mapping[str, Any]]:
    """The raw objects of a piece's value (a one-entry sequence for a List item): as _flatten."""
    if not item:
        return list(_flatten(value, where))
    (obj,) = value
    if obj is None:
        return []
    if not isinstance(obj, Mapping):
        raise ConfigError(f"expected an object, got {type(obj).__name__}", obj=where)
    return [obj]


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


def load_file(path: Path, parser: ManifestParser | None = None) -> Manifests:
    """Parse one file (with the ManifestParser of its earlier versions, if given). Raises
    ManifestReadError when it cannot be read, ConfigError when it is not UTF-8 or cannot be
    parsed at all."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ManifestReadError(err, str(path)) from None
    return (parser or ManifestParser()).parse_bytes(data, str(path))


def decode(data: bytes, source: str) -> str:
    """A manifest file's bytes as text, as Path.read_text() reads them (the locale's encoding,
    universal newlines). Raises ConfigError (not in that encoding)."""
    if data.isascii() and b"\r" not in data:
        return data.decode("ascii")
    try:
        return io.TextIOWrapper(io.BytesIO(data)).read()
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read: {err}", obj=source) from None

