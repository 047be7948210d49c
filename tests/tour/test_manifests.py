"""The tour's Services as the agent reads them: the manifest parses with usproxy's own reader
into exactly the Services the tour measures plus fillers, in the kubectl block layout whose fast
reader gives what PyYAML gives, and `a-first` and `z-last` really are first and last in the rule
order of the iptables generator the iptables datapath runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from usproxy.model.service_set import load_manifests, service_set
from usproxy.model.types import ServicePortName
from usproxy.offload.iptables import rules
from usproxy.tour import manifests as m


def test_the_yaml_reads_back_as_the_objects_it_was_written_from() -> None:
    objs = m.objects(12)
    assert yaml.safe_load(m.kubectl_yaml(objs))["items"] == objs


@pytest.mark.parametrize("n", [4, 10, 1000])
def test_the_manifest_holds_n_services_and_the_measured_ones_with_their_endpoints(tmp_path: Path, n: int) -> None:
    path = tmp_path / "services"
    m.write(path, n)
    ss = service_set(load_manifests(path))
    assert len(ss.ports) == n
    eps = {str(sp.name.service): {f"{e.ip}:{e.port}" for e in es} for sp, es in ss.ports}
    assert eps["tour/a-first"] == eps["tour/z-last"] == {f"{ip}:{m.MATCH_PORT}" for ip in m.ENDPOINTS}
    assert eps["tour/uniform"] == {f"{ip}:{m.UNIFORM_PORT}" for ip in m.ENDPOINTS}
    assert eps["tour/update"] == {f"{m.UPDATE_ENDPOINTS[0]}:{m.UPDATE_PORT}"}
    before = (path / "services.yaml").stat().st_ino
    m.write_update(path, m.UPDATE_ENDPOINTS[1])
    ss = service_set(load_manifests(path))
    assert len(ss.ports) == n
    assert {f"{e.ip}" for sp, es in ss.ports if sp.name.name == "update" for e in es} == {m.UPDATE_ENDPOINTS[1]}
    assert (path / "services.yaml").stat().st_ino == before  # an endpoint change rewrites update.yaml alone
    assert not list(path.glob(".*tmp"))


def test_first_and_last_in_the_iptables_rule_order(tmp_path: Path) -> None:
    path = tmp_path / "services"
    m.write(path, 50)
    rs = rules.build(service_set(load_manifests(path)), 4)
    services = dict(rules.ordered(rs, "nat"))["KUBE-SERVICES"]
    ips = [t for r in services for i, t in enumerate(r.tokens) if i and r.tokens[i - 1] == "-d"]
    ips = [ip.removesuffix("/32") for ip in ips]
    assert ips[0] == m.FIRST_IP and ips[-1] == m.LAST_IP and len(ips) == 50


def test_sizes_outside_the_address_range_are_refused() -> None:
    with pytest.raises(ValueError):
        m.objects(3)
    with pytest.raises(ValueError):
        m.objects(m.MAX_SERVICES + 1)
    assert m.FIRST.key == str(ServicePortName("tour", "a-first", "http", "TCP").service) + ":http"
