"""The conformance data is consistent (no netns): every pending mark names a real flow, every
address lands in a range the tests own, scenarios sharing an agent do not collide."""

from __future__ import annotations

import ipaddress
from collections import Counter

import pytest

from tests.conformance import addresses as A
from tests.conformance.datapaths import DATAPATHS, PENDING, expectation, groups_of, serves
from tests.conformance.manifests import objects, scenario_index
from tests.conformance.reference import ALL_GROUPS, GROUPS, IPTABLES_GROUPS, Group

OWNED = [ipaddress.ip_network(n) for n in ("10.96.0.0/16", "10.244.0.0/16", "192.0.2.0/24", "198.51.100.0/24",
                                           "203.0.113.0/24")]


def _flows() -> list[tuple[str, str, str, str]]:
    """(datapath, scenario key, flow name, mapped source) of every flow a datapath serves."""
    out = []
    for dp in DATAPATHS:
        for group in groups_of(dp):
            for sc in group.scenarios:
                k = scenario_index(group, sc)
                for f in sc.flows:
                    if serves(dp, A.addr(f.source, k), A.addr(f.dest, k)):
                        out.append((dp, sc.key, f.name, A.addr(f.source, k)))
    return out


def test_every_pending_mark_names_a_flow_its_datapaths_serve() -> None:
    served = {(dp, key, name) for dp, key, name, _ in _flows()}
    for p in PENDING:
        for key, name in p.flows:
            assert any((dp, key, name) in served for dp in p.datapaths), (p.item, key, name)


@pytest.mark.parametrize("groups", [GROUPS, IPTABLES_GROUPS], ids=["nftables-tests", "iptables-tests"])
def test_scenario_keys_and_flow_names_are_unique(groups: tuple[Group, ...]) -> None:
    keys = Counter(sc.key for g in groups for sc in g.scenarios)
    assert [k for k, n in keys.items() if n > 1] == []
    for g in groups:
        for sc in g.scenarios:
            names = Counter((f.name, f.phase) for f in sc.flows)
            assert [k for k, n in names.items() if n > 1] == [], sc.key


@pytest.mark.parametrize("group", ALL_GROUPS, ids=lambda g: g.key)
def test_addresses_are_owned_and_do_not_collide(group: object) -> None:
    from tests.conformance.reference import Group
    assert isinstance(group, Group)
    frontends: Counter[tuple[str, int, str]] = Counter()
    for obj in objects(group, 0):
        if obj["kind"] != "Service":  # (the ServiceCIDR object has no frontends)
            continue
        spec = obj["spec"]
        ips = [spec["clusterIP"], *spec.get("externalIPs", []),
               *(i["ip"] for i in obj.get("status", {}).get("loadBalancer", {}).get("ingress", []))]
        for ip in ips:
            assert any(ipaddress.ip_address(ip) in n for n in OWNED), ip
        for p in spec["ports"]:
            frontends.update((ip, p["port"], p["protocol"]) for ip in ips)
            if "nodePort" in p:
                frontends[("node", p["nodePort"], p["protocol"])] += 1
    assert [f for f, n in frontends.items() if n > 1] == []


def test_relay_and_bpf_expectations_state_their_reason() -> None:
    for dp in DATAPATHS:
        for group in groups_of(dp):
            for sc in group.scenarios:
                for f in sc.flows:
                    exp = expectation(dp, sc, f)
                    differs = (exp.output, exp.masq) != (f.output, f.masq if exp.masq is not None else None)
                    assert not (differs or exp.client_kept) or exp.why, (dp, sc.key, f.name)


def test_dsr_keeps_the_client_address_where_an_endpoint_is_on_another_node() -> None:
    """bpf-tc-dsr expects the client's address at exactly the peer node's endpoints of the external
    flows to a Cluster-policy NodePort or LB IP: TestInternalExternalMasquerade's svc1 and svc3 (eTP
    Cluster, one endpoint on "remote"), in each of its five configurations; nowhere else, no other
    datapath."""
    kept = {(dp, sc.key, f.name, e) for dp in DATAPATHS for g in groups_of(dp) for sc in g.scenarios for f in sc.flows
            for e in expectation(dp, sc, f).client_kept}
    iem = ("iem-base", "iem-no-localtrafficdetector", "iem-masqueradeall",
           "iem-masqueradeall-no-localtrafficdetector", "iem-base-nodecidr")
    assert kept == {("bpf-tc-dsr", k, n, e) for k in iem for n, e in
                    (("external to NodePort", "10.180.1.1:80"), ("external to NodePort with iTP:Local", "10.180.1.3:80"),
                     ("external to LB", "10.180.1.1:80"), ("external to LB with iTP:Local", "10.180.1.3:80"))}
    assert {ip for ip in _pod_ips() if A.on_peer_node(ip)} == {"10.244.101.1", "10.244.101.2", "10.244.101.3"}


def _pod_ips() -> set[str]:
    from tests.conformance.manifests import pod_addresses
    return set(pod_addresses())
