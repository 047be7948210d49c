"""ServiceCIDR objects: parsing (as kube-proxy's ParseCIDRSloppy, errors naming the field), the
union (overlaps collapsed, both families), the tracker's change notifications (kube-proxy's
ServiceCIDRConfig hands the complete set after each change), and static manifests holding a
`kind: ServiceCIDR` object, read and reloaded as the Kubernetes source reads them."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from usproxy.util.errors import ConfigError
from usproxy.model.manifest import objects_from
from usproxy.model.service_cidr import ServiceCIDR, ServiceCIDRTracker, parse_service_cidr, union
from usproxy.sources.static import StaticSource
from usproxy.model.types import IPNetwork

from tests.sources.conftest import Recorder


def net(text: str) -> IPNetwork:
    return ipaddress.ip_network(text)


def obj(name: str, *cidrs: Any) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name},
            "spec": {"cidrs": list(cidrs)}}


def test_parse_reads_spec_cidrs_as_kube_proxy() -> None:
    sc = parse_service_cidr(obj("kubernetes", "10.96.0.0/16", "fd00:96::/112"))
    assert sc == ServiceCIDR("kubernetes", (net("10.96.0.0/16"), net("fd00:96::/112")))
    # ParseCIDRSloppy: host bits and leading zeros are accepted
    assert parse_service_cidr(obj("x", "010.096.1.2/16")).cidrs == (net("10.96.0.0/16"),)
    assert parse_service_cidr({"metadata": {"name": "empty"}, "spec": {}}).cidrs == ()


@pytest.mark.parametrize("raw, where", [
    (obj("bad", "10.96.0.0/16", "10.97.0.1"), "ServiceCIDR bad: spec.cidrs[1]: '10.97.0.1'"),
    (obj("bad", "not-a-cidr/8"), "ServiceCIDR bad: spec.cidrs[0]"),
    ({"metadata": {"name": "bad"}, "spec": {"cidrs": "10.96.0.0/16"}}, "ServiceCIDR bad: spec.cidrs: must be a list"),
    ({"metadata": {}, "spec": {"cidrs": []}}, "ServiceCIDR: metadata.name: required"),
])
def test_parse_errors_name_object_and_field(raw: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_service_cidr(raw)
    assert str(err.value).startswith(where)


def test_union_collapses_overlaps_per_family() -> None:
    got = union([net("10.96.0.0/16"), net("fd00::/64")], [net("10.96.4.0/24"), net("10.97.0.0/16"), net("10.0.0.0/24")])
    assert got == (net("10.0.0.0/24"), net("10.96.0.0/15"), net("fd00::/64"))
    assert union() == ()


def test_tracker_reports_the_whole_union_only_when_it_changes() -> None:
    seen: list[tuple[IPNetwork, ...]] = []
    t = ServiceCIDRTracker(seen.append)
    a = ServiceCIDR("a", (net("10.96.0.0/16"),))
    b = ServiceCIDR("b", (net("10.96.0.0/16"), net("10.100.0.0/16")))
    t.update(None, a)
    t.update(None, b)
    t.update(b, b)  # no change in the union: nothing reported
    assert seen == [(net("10.96.0.0/16"),), (net("10.96.0.0/16"), net("10.100.0.0/16"))]
    # deleting b keeps a's CIDR, which both named (kube-proxy's string set would drop it)
    t.update(b, None)
    assert seen[-1] == (net("10.96.0.0/16"),)
    t.update(a, None)
    assert not seen[-1] and not t.cidrs  # nothing left


def test_manifest_reads_service_cidr_objects() -> None:
    m = objects_from([obj("kubernetes", "10.96.0.0/16"), obj("bad", "nope")])
    assert m.service_cidrs == {"kubernetes": ServiceCIDR("kubernetes", (net("10.96.0.0/16"),))}
    assert [str(e) for e in m.errors] == ["ServiceCIDR bad: spec.cidrs[0]: 'nope': must be a CIDR (address/prefix length)"]


class CidrRecorder(Recorder):
    """A Provider that also takes the Service CIDRs."""

    def __init__(self) -> None:
        super().__init__()
        self.cidrs: list[tuple[IPNetwork, ...]] = []

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        self.cidrs.append(cidrs)


def test_static_source_hands_the_service_cidrs_to_the_provider(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "cidr.yaml").write_text(yaml.safe_dump(obj("kubernetes", "10.96.0.0/16")))
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(obj("extra", "10.100.0.0/16")))
    rec = CidrRecorder()
    src = StaticSource(tmp_path, rec, settle=0.0)
    src.load_initial()
    assert rec.cidrs == [(net("10.96.0.0/16"), net("10.100.0.0/16"))]
    (tmp_path / "more.yaml").unlink()
    assert src.poll()
    assert rec.cidrs[-1] == (net("10.96.0.0/16"),)
    assert not src.poll() and len(rec.cidrs) == 2  # nothing changed: nothing reported
