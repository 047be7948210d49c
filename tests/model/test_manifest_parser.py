"""ManifestParser and the cut into pieces (usproxy/model/manifest.py, manifest_pieces.py): the same
objects and errors as one PyYAML parse of the whole text, and a rewritten file read again only
where it changed."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from usproxy.model import manifest
from usproxy.model.manifest import ManifestParser, Manifests, objects_from, parse_documents
from usproxy.model.manifest_pieces import cut
from usproxy.util.errors import ConfigError


def service(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"s{i}", "namespace": "ns"},
            "spec": {"clusterIP": f"10.96.1.{i + 1}", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def endpoint_slice(i: int, ip: str) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"s{i}-1", "namespace": "ns", "labels": {"kubernetes.io/service-name": f"s{i}"}},
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}]}


def as_list(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs, "metadata": {"resourceVersion": ""}},
                          sort_keys=False)


def objects(n: int, changed: int | None = None) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        out += [service(i), endpoint_slice(i, f"10.244.0.{i + 1}" if i != changed else "10.244.9.9")]
    return out


def whole(text: str) -> Manifests:
    """The reference: one PyYAML parse of the whole text."""
    return objects_from(manifest._parse_whole(text, "f.yaml"))


def same(a: Manifests, b: Manifests) -> bool:
    return (a.services, a.slices, [str(e) for e in a.errors], a.skipped) == \
        (b.services, b.slices, [str(e) for e in b.errors], b.skipped)


class Counting:
    """Counts the pieces read (manifest._load_piece)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.texts: list[str] = []
        real = manifest._load_piece

        def counted(text: str, memo: dict[str, Any]) -> Any:
            self.texts.append(text)
            return real(text, memo)
        monkeypatch.setattr(manifest, "_load_piece", counted)


def test_a_list_is_cut_into_its_items_and_parsed_as_a_whole_parse_would() -> None:
    text = as_list(objects(20))
    (doc,) = cut(text) or []
    assert doc.items is not None and len(list(doc.item_spans())) == 40
    assert doc.skeleton is not None and "items:" in doc.skeleton and "s0" not in doc.skeleton
    assert same(ManifestParser().parse(text, "f.yaml"), whole(text))
    assert parse_documents(text, "f.yaml") == manifest._parse_whole(text, "f.yaml")


def test_a_rewritten_file_is_read_again_only_where_it_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One endpoint changed in a file of 20 Services: one piece is read again, every other object
    is the very object of the last parse (so the static source compares by identity)."""
    parser = ManifestParser()
    before = parser.parse(as_list(objects(20)), "f.yaml")
    counting = Counting(monkeypatch)
    after = parser.parse(as_list(objects(20, changed=7)), "f.yaml")
    assert len(counting.texts) == 2 and "10.244.9.9" in counting.texts[1]  # the skeleton and the item
    assert same(after, whole(as_list(objects(20, changed=7))))
    changed = [name.name for name in before.slices if before.slices[name] is not after.slices[name]]
    assert changed == ["s7-1"]
    assert all(before.services[k] is after.services[k] for k in before.services)


def test_documents_are_pieces_too(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [yaml.safe_dump(o, sort_keys=False) for o in objects(5)]
    parser = ManifestParser()
    parser.parse("---\n".join(docs), "f.yaml")
    counting = Counting(monkeypatch)
    docs[3] = yaml.safe_dump(endpoint_slice(1, "10.244.7.7"), sort_keys=False)
    text = "---\n".join(docs)
    assert same(parser.parse(text, "f.yaml"), whole(text))
    assert counting.texts == [docs[3]]


@pytest.mark.parametrize("text", [
    # a `- ` line at column 0 inside a multi-line quoted scalar: the cut does not hold
    'kind: List\nitems:\n- kind: Service\n  metadata:\n    name: "a\n- b"\n',
    # an alias to an anchor of another item
    "kind: List\nitems:\n- &one {kind: Service, metadata: {name: a}}\n- *one\n",
    # `items:` of a document that is not a List: the document is one object
    "kind: Service\nmetadata: {name: a}\nitems:\n- x\n",
    # a plain list document, a null item, comments between items
    "- kind: Service\n  metadata: {name: a}\n# c\n-\n- kind: Service\n  metadata: {name: b}\n",
    "",
    "---\n---\n",
    "a: 1\n...\n",
])
def test_texts_whose_cut_does_not_hold_give_the_whole_parse(text: str) -> None:
    try:
        want: Any = [str(e) for e in whole(text).errors], whole(text).services
    except ConfigError as err:
        want = str(err)
    try:
        m = ManifestParser().parse(text, "f.yaml")
        got: Any = [str(e) for e in m.errors], m.services
    except ConfigError as err:
        got = str(err)
    assert got == want


def test_a_broken_item_is_reported_at_its_line_and_column_of_the_file() -> None:
    text = as_list(objects(3)).replace("    name: s2\n", "    name: [s2\n", 1)
    with pytest.raises(ConfigError) as err:
        ManifestParser().parse(text, "f.yaml")
    with pytest.raises(ConfigError) as ref:
        manifest._parse_whole(text, "f.yaml")
    assert str(err.value) == str(ref.value) and " at line " in str(err.value)


def test_an_item_that_is_not_an_object_is_named_by_document_and_item() -> None:
    text = "a: 1\n---\nkind: List\nitems:\n- kind: Service\n  metadata: {name: a}\n- 42\n"
    with pytest.raises(ConfigError, match=r"f.yaml: document 1 item 1: expected an object, got int"):
        ManifestParser().parse(text, "f.yaml")


class Helper:
    """A PieceHelper in this process: `parse_share` of the same text from `start` on, or nothing
    (`deliver=False`: the helper failed)."""

    def __init__(self, text: str, start: int, deliver: bool = True) -> None:
        self.start = start
        self.share = manifest.parse_share(text, start, "f.yaml") if deliver else None
        self.asked = 0

    def result(self) -> dict[bytes, Any] | None:
        self.asked += 1
        return dict(self.share) if self.share is not None else None


def mixed(n: int) -> list[dict[str, Any]]:
    """n Services and slices with a bad object, a skipped Service and an ignored kind spread over the text."""
    objs = objects(n)
    objs[2]["spec"]["ports"][0]["port"] = "eighty"  # an error in the first part
    objs[-2]["metadata"]["name"] = "Bad_Name"  # and one in the last
    objs[n]["spec"]["type"] = "ExternalName"  # skipped
    objs.insert(n // 2, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})
    return objs


@pytest.mark.parametrize("at", [0.0, 0.3, 0.7, 1.0])
def test_a_text_parsed_in_two_parts_gives_what_one_parse_gives(at: float) -> None:
    """The pieces from `start` on come from the helper (sources/parse_helper.py forks one): the
    same objects, errors (named by document and item) and skipped Services as one parse, and the
    parser keeps every piece for the next text."""
    text = as_list(mixed(20))
    helper = Helper(text, int(len(text) * at))
    parser = ManifestParser()
    helped = parser.parse(text, "f.yaml", helper)
    assert same(helped, whole(text)) and helped.errors and helped.skipped
    assert helper.asked == (1 if helper.share else 0)  # asked once, and only when it has pieces
    again = parser.parse(text, "f.yaml")
    assert all(again.services[k] is helped.services[k] for k in helped.services)


def test_pieces_the_helper_does_not_deliver_are_parsed_here() -> None:
    text = as_list(mixed(20))
    helper = Helper(text, len(text) // 2, deliver=False)
    assert same(ManifestParser().parse(text, "f.yaml", helper), whole(text)) and helper.asked == 1


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_text_broken_in_either_part_is_reported_at_its_line_and_column(where: str) -> None:
    name = "s1" if where == "first" else "s18"
    text = as_list(objects(20)).replace(f"    name: {name}\n", f"    name: [{name}\n", 1)
    helper = Helper(text, len(text) // 2)
    assert helper.share is None or where == "first"  # the helper's part did not parse alone: nothing
    with pytest.raises(ConfigError) as err:
        ManifestParser().parse(text, "f.yaml", helper)
    with pytest.raises(ConfigError) as ref:
        manifest._parse_whole(text, "f.yaml")
    assert str(err.value) == str(ref.value) and " at line " in str(err.value)
