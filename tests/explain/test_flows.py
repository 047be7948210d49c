"""Every mode's trace against kube-proxy's packet-flow tests (tests/explain/flows/flows.yaml).

Each flow of kube-proxy's nftables tests (runPacketFlowTests; TestLoadBalancer's included), and
the one of the iptables TestHealthCheckNodePort, is traced in all five modes over the Services of
that test; the endpoints reached (or REJECT / DROP / ACCEPT / "" for not handled) and the
masquerade mark must be kube-proxy's, or the per-mode difference the data names with its reason.
A second set of tests holds each tracer to the text its mode renders: every rule counted is a rule
printed, and the trace lists it (as matched, or in a run of rules that did not match).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.explain.kube_proxy_flows import DATA, flow_packet, flow_set
from usproxy.explain import ipvs, nftables, registry, userspace
from usproxy.offload.iptables import rules as iptables
from usproxy.explain.packet import Path
from usproxy.model.service_set import ServiceSet


@dataclass(frozen=True, slots=True)
class Flow:
    test: str
    name: str
    src: str
    dst: str
    output: str
    masq: bool

    def __str__(self) -> str:
        return f"{self.test}: {self.name}"


def _flows() -> list[tuple[str, Flow]]:
    out = []
    for test, flows in DATA["tests"].items():
        for f in flows:
            for mode in registry.NAMES:
                want = {"output": f["output"], "masq": f["masq"], **f.get("modes", {}).get(mode, {})}
                out.append((mode, Flow(test, f["name"], f["src"], f["dst"], want["output"], want["masq"])))
    return out


def _trace(mode: str, test: str, src: str, dst: str) -> list[Path]:
    ss = flow_set(test)
    return registry.by_name(mode).trace(ss, flow_packet(ss, src, dst))


@pytest.mark.parametrize(("mode", "flow"), _flows(), ids=lambda v: str(v))
def test_flow(mode: str, flow: Flow) -> None:
    paths = _trace(mode, flow.test, flow.src, flow.dst)
    assert sum(p.share for p in paths) == 1
    assert ", ".join(sorted({p.lands for p in paths})) == ", ".join(sorted(flow.output.split(", ")))
    assert {p.masquerade for p in paths} == {flow.masq}


def test_every_mode_differs_from_nftables_only_with_a_reason() -> None:
    for flows in DATA["tests"].values():
        for f in flows:
            assert "nftables" not in f.get("modes", {})
            assert all(o.get("why") for o in f.get("modes", {}).values()), f["name"]


def test_random_choices_split_evenly() -> None:
    for mode in registry.NAMES:
        paths = _trace(mode, "TestClusterIPGeneral", "10.180.0.2", "172.30.0.42:80/TCP")
        assert [p.share for p in paths] == [pytest.approx(0.5)] * 2, mode


# --- the trace follows, and counts, only the rules its mode prints -------------------------

VIEWS: dict[str, Callable[[ServiceSet], str]] = {"iptables": iptables.render, "ipvs": ipvs.render, "userspace": userspace.render,
         "nftables": lambda ss: nftables.render(ss, "dump")}


@pytest.mark.parametrize("mode", sorted(VIEWS))
@pytest.mark.parametrize("test", sorted(DATA["tests"]))
def test_every_rule_counted_is_printed_by_the_view_and_listed_by_the_trace(mode: str, test: str) -> None:
    ss = flow_set(test)
    printed = VIEWS[mode](ss)
    for f in DATA["tests"][test]:
        for p in registry.by_name(mode).trace(ss, flow_packet(ss, f["src"], f["dst"])):
            assert p.rules == len(p.walked) == p.matched + p.skipped  # each one listed
            assert all(rule in printed for rule in p.walked), f["name"]


def test_nodeport_trace_does_not_match_the_clusterip_masquerade_rule() -> None:
    for mode in ("nftables", "iptables"):
        for p in _trace(mode, "TestExternalTrafficPolicyCluster", "203.0.113.2", "192.168.0.2:3001/TCP"):
            assert not [h for h in p.hops if "172.30.0.41" in h], mode
            assert any("mark-for-masquerade" in h or "KUBE-MARK-MASQ" in h for h in p.hops)


def test_ipvs_counts_its_own_rules_and_says_masq_is_not_source_nat() -> None:
    cluster = _trace("ipvs", "TestExternalTrafficPolicyCluster", "10.0.0.2", "172.30.0.41:80/TCP")
    nodeport = _trace("ipvs", "TestExternalTrafficPolicyCluster", "203.0.113.2", "192.168.0.2:3001/TCP")
    assert cluster[0].rules != nodeport[0].rules
    assert all(p.masquerade and "KUBE-MARK-MASQ" in " ".join(p.hops) for p in nodeport)
    assert all("not source NAT" in p.result for p in cluster + nodeport)


def test_ipvs_hairpin_is_masqueraded_by_the_loop_back_ipset() -> None:
    (p,) = _trace("ipvs", "TestClusterIPGeneral", "10.180.0.1", "172.30.0.41:80/TCP")
    assert p.masquerade and "KUBE-LOOP-BACK" in p.hops[-1]


def test_bpf_external_nodeport_is_served_at_tc_not_at_connect() -> None:
    for p in _trace("bpf", "TestExternalTrafficPolicyCluster", "203.0.113.2", "192.168.0.2:3001/TCP"):
        assert "connect() rewrote" not in p.result and p.result.startswith("tc: DNAT to ")
        assert any("usp_tc_ingress" in h for h in p.hops) and not any("fallback" in h for h in p.hops)
    for p in _trace("bpf", "TestExternalTrafficPolicyCluster", "10.0.0.2", "172.30.0.41:80/TCP"):
        assert "connect() rewrote" in p.result and p.rules == 0


def test_bpf_pod_here_to_nodeport_is_served_at_tc_on_the_pod_bridge() -> None:
    """usproxy's socket LB makes ClusterIP frontends only (datapath.py _wants): a pod's packet to a
    NodePort leaves through the pod bridge and usp_tc_ingress there DNATs and SNATs it."""
    paths = _trace("bpf", "TestExternalTrafficPolicyCluster", "10.0.0.2", "192.168.0.2:3001/TCP")
    assert sorted(p.lands for p in paths) == ["10.180.0.1:80", "10.180.2.1:80"]
    for p in paths:
        assert p.result.startswith("tc: DNAT to ") and "SNAT" in p.result and p.masquerade
        assert "connect() rewrote" not in p.result and not any("fallback" in h for h in p.hops)
        assert p.hops[0].startswith("socket LB: not on this path") and "F_TC_ONLY" in p.hops[0]
        assert p.hops[1].startswith("pod bridge: 10.0.0.2") and "usp_tc_ingress" in p.hops[2]


def test_bpf_pod_here_to_etp_local_nodeport_reaches_local_endpoints_only() -> None:
    paths = _trace("bpf", "TestExternalTrafficPolicyLocal", "10.0.0.2", "192.168.0.2:3001/TCP")
    assert [p.lands for p in paths] == ["10.180.2.1:80"] and not paths[0].masquerade
    assert any(h.startswith("externalTrafficPolicy Local holds for a pod here") for h in paths[0].hops)


def test_bpf_node_to_nodeport_goes_through_the_fallback_not_connect_or_tc() -> None:
    for dst in ("192.168.0.2:3001/TCP", "192.168.99.11:80/TCP", "1.2.3.4:80/TCP"):
        paths = _trace("bpf", "TestExternalTrafficPolicyCluster", "192.168.0.2", dst)
        assert sorted(p.lands for p in paths) == ["10.180.0.1:80", "10.180.2.1:80"], dst
        for p in paths:
            assert p.result.startswith("nftables fallback: ") and "connect() rewrote" not in p.result
            assert p.hops[0].startswith("socket LB: not on this path") and "F_TC_ONLY" in p.hops[0]
            assert p.hops[1].startswith("tc: not on this path: 192.168.0.2 is this node")
            assert not any(h.startswith("tc ingress") for h in p.hops)


def test_bpf_pod_here_to_clusterip_is_still_served_at_connect() -> None:
    paths = _trace("bpf", "TestExternalTrafficPolicyCluster", "10.0.0.2", "172.30.0.41:80/TCP")
    assert sorted(p.lands for p in paths) == ["10.180.0.1:80", "10.180.2.1:80"]
    for p in paths:
        assert "connect() rewrote" in p.result and not p.masquerade
        assert not any(h.startswith(("tc ingress", "served on this node by")) for h in p.hops)


def test_userspace_from_the_node_walks_kube_portals_host_dnat() -> None:
    ss = flow_set("TestNodePorts")
    port = userspace.proxy_port(ss.family_ports(4)[0])
    for p in _trace("userspace", "TestNodePorts", "192.168.0.2", "172.30.0.41:80/TCP"):
        text = "\n".join(p.hops)
        assert "KUBE-PORTALS-HOST" in text and f"DNAT to 192.168.0.2:{port}" in text
        assert "REDIRECT" not in text
    for p in _trace("userspace", "TestNodePorts", "10.0.0.2", "172.30.0.41:80/TCP"):
        assert "KUBE-PORTALS-CONTAINER" in "\n".join(p.hops) and f"REDIRECT to port {port}" in "\n".join(p.hops)
