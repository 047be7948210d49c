"""ManifestParser.parse_bytes and the layout of the last text (usproxy/model/manifest_layout.py): a
rewrite is cut and parsed only around what changed, and gives exactly what one PyYAML parse of the
whole text gives (objects, errors, skipped), whatever the edit: an endpoint, items added, removed
or moved, a name defined twice, a broken edit and the good one after it, the List's skeleton, a
new document, a non-ASCII or CRLF text (cut whole)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from usproxy.model import manifest, manifest_pieces
from usproxy.model.manifest import ManifestParser, Manifests, objects_from
from usproxy.model.manifest_layout import RUN
from usproxy.util.errors import ConfigError


def service(i: int, port: int = 80) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"s{i}", "namespace": "ns"},
            "spec": {"clusterIP": f"10.96.{i // 250}.{i % 250 + 1}",
                     "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}


def endpoint_slice(i: int, ip: str) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"s{i}-1", "namespace": "ns", "labels": {"kubernetes.io/service-name": f"s{i}"}},
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}]}


def objects(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [service(i), endpoint_slice(i, f"10.244.{i // 250}.{i % 250 + 1}")]
    return out


def as_list(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "items": objs, "kind": "List", "metadata": {"resourceVersion": ""}},
                          sort_keys=False)


def whole(text: str) -> Manifests | str:
    """The reference: one PyYAML parse of the whole text (or its error)."""
    try:
        return objects_from(manifest._parse_whole(text, "f.yaml"))
    except ConfigError as err:
        return str(err)


def parsed(parser: ManifestParser, text: str) -> Manifests | str:
    try:
        return parser.parse_bytes(text.encode(), "f.yaml")
    except ConfigError as err:
        return str(err)


def same(a: Manifests | str, b: Manifests | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (a.services, a.slices, sorted(map(str, a.errors)), sorted(a.skipped)) == \
        (b.services, b.slices, sorted(map(str, b.errors)), sorted(b.skipped))


class Reads:
    """Counts the pieces parsed (manifest._load_piece) and the texts cut whole (manifest.cut)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pieces = self.cuts = 0
        load, cut = manifest._load_piece, manifest_pieces.cut

        def counted_load(text: str, memo: dict[str, Any]) -> Any:
            self.pieces += 1
            return load(text, memo)

        def counted_cut(text: str) -> Any:
            self.cuts += 1
            return cut(text)
        monkeypatch.setattr(manifest, "_load_piece", counted_load)
        monkeypatch.setattr(manifest, "cut", counted_cut)


N = 300  # Services: ~150 KB, a few dozen runs


def test_an_endpoint_changed_in_the_middle_is_read_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = ManifestParser()
    objs = objects(N)
    before = parser.parse_bytes(as_list(objs).encode(), "f.yaml")
    assert len(as_list(objs)) > 8 * RUN
    reads = Reads(monkeypatch)
    objs[N + 1] = endpoint_slice(N // 2, "10.244.99.99")
    after = parser.parse_bytes(as_list(objs).encode(), "f.yaml")
    assert reads.cuts == 0 and reads.pieces == 1
    assert same(after, whole(as_list(objs)))
    changed = [k for k in before.slices if before.slices[k] is not after.slices[k]]
    assert [k.name for k in changed] == [f"s{N // 2}-1"]
    assert all(before.services[k] is after.services[k] for k in before.services)
    assert parser.parse_bytes(as_list(objs).encode(), "f.yaml") is after  # the same bytes again


EDITS = ["endpoint", "insert", "remove", "append", "first", "rename_twice", "break", "skeleton", "document",
         "non_ascii", "crlf", "port"]


def edit(objs: list[dict[str, Any]], what: str, rnd: random.Random) -> tuple[list[dict[str, Any]], str | None]:
    """`objs` edited; the text itself when the edit is not of objects."""
    objs = [dict(o) for o in objs]
    at = rnd.randrange(len(objs))
    if what == "endpoint":
        objs[at | 1] = endpoint_slice(at // 2, f"10.244.200.{rnd.randrange(1, 250)}")
    elif what == "insert":
        objs.insert(at, service(1000 + rnd.randrange(1000)))
    elif what == "remove":
        del objs[at]
    elif what == "append":
        objs.append(service(2000 + rnd.randrange(1000)))
    elif what == "first":
        objs[0] = service(0, port=81)
    elif what == "rename_twice":  # a name defined by two items: the later one wins
        objs[at] = objs[(at + 10) % len(objs)]
    elif what == "port":
        objs[at & ~1] = service(at // 2, port=rnd.randrange(1, 65536))
    text = as_list(objs)
    if what == "break":
        line = f"    name: s{at // 2}\n"
        return objs, text.replace(line, f"    name: [s{at // 2}\n", 1)
    if what == "skeleton":
        return objs, text.replace('resourceVersion: ""', 'resourceVersion: "7"')
    if what == "document":
        return objs, text + "---\n" + yaml.safe_dump(service(5000))
    if what == "non_ascii":
        return objs, text.replace("    namespace: ns\n", "    namespace: ns\n    # é\n", 1)
    if what == "crlf":
        return objs, text.replace("\n", "\r\n")
    return objs, None


@settings(max_examples=12, deadline=None)  # each example parses ~150 KB whole up to 5 times: 53 s at 25 x 6
@given(st.lists(st.sampled_from(EDITS), min_size=1, max_size=4), st.integers(0, 2**32))
def test_any_sequence_of_edits_gives_what_one_parse_gives(edits: list[str], seed: int) -> None:
    rnd = random.Random(seed)
    parser = ManifestParser()
    objs = objects(N)
    assert same(parsed(parser, as_list(objs)), whole(as_list(objs)))
    for what in edits:
        objs, text = edit(objs, what, rnd)
        text = text if text is not None else as_list(objs)
        assert same(parsed(parser, text), whole(text)), what


def test_a_broken_edit_then_a_good_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite that cannot be parsed leaves the parser at the last good text: the good edit after
    it is still read around its change alone."""
    parser = ManifestParser()
    objs = objects(N)
    parser.parse_bytes(as_list(objs).encode(), "f.yaml")
    broken = as_list(objs).replace("    name: s7\n", "    name: [s7\n", 1)
    assert parsed(parser, broken) == whole(broken) and " at line " in str(whole(broken))
    reads = Reads(monkeypatch)
    objs[2 * 100 + 1] = endpoint_slice(100, "10.244.98.98")
    assert same(parsed(parser, as_list(objs)), whole(as_list(objs))) and reads.cuts == 0
