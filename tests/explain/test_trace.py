"""Tracing one new connection through each mode's rules: shares, landings, refusals, policies."""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import replace
from fractions import Fraction

import pytest

from tests.explain.conftest import FIXTURES, NODE, load
from usproxy.util.errors import ConfigError
from usproxy.explain import iptables_trace, nftables_trace, registry, reply, trace
from usproxy.explain.mode import TraceOptions
from usproxy.explain.packet import Packet, Path
from usproxy.model.service_set import Node, ServiceSet
from usproxy.model.config import BpfLbMode
from usproxy.model.service_port import LBPolicy
from usproxy.offload.bpf import maglev
from usproxy.offload.bpf.layout import MAGLEV_M


def landings(mode: str, fixture: str, src: str, dst: str) -> dict[str, Fraction]:
    ss = load(fixture)
    paths = registry.by_name(mode).trace(ss, trace.parse_packet(src, dst, ss))
    assert sum(p.share for p in paths) == 1
    out: dict[str, Fraction] = {}
    for p in paths:
        out[p.result] = out.get(p.result, Fraction(0)) + p.share
    return out


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_three_endpoints_one_third_each(mode: str) -> None:
    got = landings(mode, "clusterip", "10.244.9.9", "10.96.1.1:80/TCP")
    assert sorted(got.values()) == [Fraction(1, 3)] * 3
    assert {r.split()[-1] for r in got} == {"10.244.1.5:8080", "10.244.2.7:8080", "10.244.3.9:8080"}


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_zero_endpoints_are_rejected(mode: str) -> None:
    assert landings(mode, "clusterip", "10.244.9.9", "10.96.1.3:80/TCP") == {"REJECT": 1}


def test_only_a_terminating_endpoint_is_not_used_while_a_ready_one_exists() -> None:
    got = landings("nftables", "clusterip", "10.244.9.9", "10.96.1.2:443/TCP")
    assert got == {"dnat to 10.244.2.20:8443": 1}


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_external_client_to_local_policy_nodeport_stays_on_node(mode: str) -> None:
    got = landings(mode, "nodeport", "203.0.113.7", "192.168.0.2:30081/TCP")
    assert [r.split()[-1] for r in got] == ["10.244.1.31:8080"]


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_external_client_to_local_policy_without_local_endpoint_is_dropped(mode: str) -> None:
    assert landings(mode, "nodeport", "203.0.113.7", "192.168.0.2:30082/TCP") == {"DROP": 1}


def test_pod_to_local_policy_nodeport_is_short_circuited_to_cluster_endpoints() -> None:
    got = landings("iptables", "nodeport", "10.244.9.9", "192.168.0.2:30082/TCP")
    assert got == {"DNAT to 10.244.2.32:8080": 1}


def test_cluster_policy_nodeport_masquerades() -> None:
    ss = load("nodeport")
    paths = trace.trace_iptables(ss, trace.parse_packet("203.0.113.7", "192.168.0.2:30080/TCP", ss))
    assert all(p.masquerade for p in paths) and len(paths) == 2


def test_udp_and_tcp_on_the_same_port_are_different_service_ports() -> None:
    udp = landings("nftables", "affinity_udp", "10.244.9.9", "10.96.0.10:53/UDP")
    tcp = landings("iptables", "affinity_udp", "10.244.9.9", "10.96.0.10:53/TCP")
    assert set(udp) == {"dnat to 10.244.0.3:53", "dnat to 10.244.0.4:53"}
    assert set(tcp) == {"DNAT to 10.244.0.3:53", "DNAT to 10.244.0.4:53"}


def test_ipv6_is_traced_in_the_ip6_table() -> None:
    got = landings("nftables", "dualstack", "fd00:10:244::9", "[fd00:10:96::4:1]:80/TCP")
    assert set(got) == {"dnat to [fd00:10:244::6:1]:8080", "dnat to [fd00:10:244::6:2]:8080"}


@pytest.mark.parametrize("mode", ["ipvs", "bpf", "userspace"])
def test_other_modes_split_evenly(mode: str) -> None:
    got = landings(mode, "clusterip", "10.244.9.9", "10.96.1.1:80/TCP")
    assert sorted(got.values()) == [Fraction(1, 3)] * 3


def test_render_names_every_mode() -> None:
    ss = load("affinity_udp")
    text = trace.render(ss, trace.parse_packet("10.244.9.9", "10.96.3.1:8000/TCP", ss), registry.MODES)
    assert all(f"## {m}:" in text for m in registry.NAMES)


@pytest.mark.parametrize("dst", ["10.96.1.1", "10.96.1.1:http/TCP", "10.96.1.1:80/ICMP", "[fd00::1]:80/TCP"])
def test_bad_destination_is_a_config_error(dst: str) -> None:
    with pytest.raises(ConfigError):
        trace.parse_packet("10.0.0.1", dst, load("clusterip"))


@pytest.mark.parametrize("dst", ["10.96.1.1:99999", "10.96.1.1:0/UDP", "10.96.1.1:-1"])
def test_a_port_outside_1_to_65535_is_refused_not_traced(dst: str) -> None:
    """It traced to "no Service's frontend" with exit 0."""
    with pytest.raises(ConfigError, match=r"port must be between 1 and 65535"):
        trace.parse_packet("10.0.0.1", dst, load("clusterip"))


def test_a_destination_without_protocol_is_tcp() -> None:
    """The usage line says DST:PORT[/PROTO]: left out, the protocol is TCP."""
    bare = trace.parse_packet("10.0.0.1", "10.96.1.1:80", load("clusterip"))
    assert (bare.proto, bare.dport) == ("TCP", 80)
    assert bare == trace.parse_packet("10.0.0.1", "10.96.1.1:80/tcp", load("clusterip"))


def test_a_jump_to_an_undeclared_chain_is_reported_as_refused_input() -> None:
    pkt = Packet(ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("10.96.0.1"), 80, "TCP")
    ipt = iptables_trace.Walker(iptables_trace.parse_restore("*nat\n:A - [0:0]\n-A A -j B\nCOMMIT\n"), pkt)
    (p,) = ipt.walk("nat", "A", Path())
    assert p.lands == "ERROR" and "iptables-restore would refuse" in p.result
    dump = "add chain ip kube-proxy a\nadd rule ip kube-proxy a numgen random mod 1 vmap { 0 : goto b }\n"
    ended, through = nftables_trace.Walker(nftables_trace.parse_dump(dump), pkt).walk("a", Path())
    assert not through and [q.lands for q in ended] == ["ERROR"] and "nft would refuse" in ended[0].result


def _bpf_hops(src: str, node: Node = NODE, annotations: LBPolicy | None = None) -> list[str]:
    ss = load("clusterip", node)
    if annotations is not None:
        ss = _annotated(ss, annotations)
    paths = trace.trace_bpf(ss, trace.parse_packet(src, "10.96.1.1:80/TCP", ss))
    return [h for p in paths for h in p.hops]


def _annotated(ss: ServiceSet, policy: LBPolicy) -> ServiceSet:
    """The same ServicePorts, each annotated usproxy.io/lb-policy POLICY."""
    return replace(ss, ports=tuple((replace(sp, lb_policy=policy), eps) for sp, eps in ss.ports))


def test_bpf_pod_outside_cluster_cidr_is_not_said_to_connect_on_another_machine() -> None:
    """Without --cluster-cidr the trace cannot tell a pod here from a client elsewhere: it says
    the socket LB serves processes on this node and traces the packet from elsewhere."""
    hops = _bpf_hops("10.244.9.9", replace(NODE, cluster_cidrs=()))
    assert not any("another machine" in h for h in hops)
    assert any("processes on this node inside the BPF cgroup" in h and "arriving from elsewhere" in h
               for h in hops)
    assert any("fallback" in h for h in hops)


def test_bpf_pod_in_cluster_cidr_is_traced_at_connect_and_says_so() -> None:
    hops = _bpf_hops("10.244.9.9")
    assert any("is a pod on this node (in --cluster-cidr), inside the BPF cgroup" in h for h in hops)
    assert not any(h.startswith("socket LB") for h in _bpf_hops("192.168.0.2"))  # the node itself


def test_bpf_slot_selection_is_the_agents_round_robin_unless_annotated() -> None:
    """The agent's socket LB picks by --lb-policy (default roundRobin) or the annotation
    (usproxy/offload/bpf/datapath.py _flags), not at random as Cilium."""
    assert sum("slot by round robin" in h and "default --lb-policy roundRobin" in h
               for h in _bpf_hops("10.244.9.9")) == 3
    assert sum(h.startswith("slot chosen at random (usproxy.io/lb-policy random)")
               for h in _bpf_hops("10.244.9.9", annotations="random")) == 3


# --- bpf: a packet from elsewhere through usproxy's tc program (usproxy/offload/bpf/tc_frontends.h)

EXTERNAL = "203.0.113.7"


def _tc(fixture: str, dst: str, src: str = EXTERNAL, lb_mode: BpfLbMode = "snat",
        ss: ServiceSet | None = None) -> list[Path]:
    ss = ss or load(fixture)
    paths = trace.trace_bpf(ss, trace.parse_packet(src, dst, ss), TraceOptions(lb_mode))
    assert sum(p.share for p in paths) == 1
    return paths


def _by_backend(paths: list[Path]) -> dict[str, Path]:
    return {p.lands: p for p in paths}


def test_bpf_external_nodeport_snat_is_served_at_tc_with_maglev_shares() -> None:
    """eTP=Cluster: the Maglev table's own shares; the backend on node-b is SNATed to this node
    and its reply reverse-NATed here; nothing goes to the nftables fallback."""
    paths = _by_backend(_tc("nodeport", "192.168.0.2:30080/TCP"))
    owned = Counter(maglev.table(["10.244.1.30:8080", "10.244.2.30:8080"], MAGLEV_M))
    assert {k: p.share for k, p in paths.items()} == {
        "10.244.1.30:8080": Fraction(owned[0], MAGLEV_M), "10.244.2.30:8080": Fraction(owned[1], MAGLEV_M)}
    remote = paths["10.244.2.30:8080"]
    text = "\n".join(remote.hops)
    assert "usp_tc_ingress" in text and "usp_services[0.0.0.0:30080/TCP]" in text and "F_TC_ONLY" in text
    assert f"usp_maglev[1], a table of {MAGLEV_M}" in text and "fallback" not in text
    assert remote.masquerade and "SNAT to this node's address" in remote.result
    ss = load("nodeport")
    pkt = trace.parse_packet(EXTERNAL, "192.168.0.2:30080/TCP", ss)
    after = "\n".join(reply.lines(registry.by_name("bpf"), ss, pkt, remote))
    assert "usp_ct" in after and "sees the connection from this node's address" in after
    assert f"destination back to {EXTERNAL}:<port> (un-SNAT)" in after


def test_bpf_external_nodeport_dsr_keeps_the_client_and_replies_from_the_backend_node() -> None:
    paths = _by_backend(_tc("nodeport", "192.168.0.2:30080/TCP", lb_mode="dsr"))
    remote, local = paths["10.244.2.30:8080"], paths["10.244.1.30:8080"]
    assert remote.result.startswith("tc: DSR: DNAT to 10.244.2.30:8080") and "0x9a" in remote.result
    assert "192.168.0.2:30080 to the backend's node" in remote.result and not remote.masquerade
    assert "DSR" not in local.result and local.masquerade  # a local backend is served as in SNAT mode
    ss = load("nodeport")
    after = "\n".join(reply.lines(registry.by_name("bpf"), ss, trace.parse_packet(EXTERNAL, "192.168.0.2:30080/TCP", ss), remote))
    assert f"sees the client's own address {EXTERNAL}" in after and "it never passes this node" in after
    assert "only the ORIGINAL entry" in after and "REPLY entry 10.244.2.30:8080" in after


def test_bpf_lb_ip_outside_source_ranges_is_dropped_at_tc() -> None:
    (p,) = _tc("kube_proxy_overall", "5.6.7.8:80/TCP", src="198.51.100.1")
    assert p.lands == "DROP" and p.result.startswith("tc: dropped")
    assert any("usp_tc_sources" in h and "203.0.113.0/25" in h and "outside" in h for h in p.hops)
    assert any("usp_services[5.6.7.8:80/TCP] (LoadBalancer)" in h for h in p.hops)
    (inside,) = _tc("kube_proxy_overall", "5.6.7.8:80/TCP", src="203.0.113.1")
    assert inside.lands == "10.180.0.3:80" and any("usp_affinity" in h for h in inside.hops)


def test_bpf_external_local_policy_keeps_the_client_and_drops_without_local_endpoint() -> None:
    (p,) = _tc("nodeport", "192.168.0.2:30081/TCP")
    assert p.lands == "10.244.1.31:8080" and not p.masquerade and "client's address is kept" in p.result
    (dsr,) = _tc("nodeport", "192.168.0.2:30081/TCP", lb_mode="dsr")
    assert "DSR" not in dsr.result  # eTP=Local never leaves the node
    (drop,) = _tc("nodeport", "192.168.0.2:30082/TCP")
    assert drop.lands == "DROP" and "F_DROP_EMPTY" in drop.result


def test_bpf_external_ipv6_keeps_the_nftables_fallback() -> None:
    ss = load("dualstack")
    ss = replace(ss, ports=tuple((replace(sp, node_port=30090), eps) for sp, eps in ss.ports))
    v6 = _tc("", "[2001:db8::2]:30090/TCP", src="2001:db8::7", ss=ss)
    assert all(p.result.startswith("nftables fallback: ") for p in v6)
    assert all(any(h.startswith("tc ingress: IPv6") for h in p.hops) for p in v6)
    v4 = _tc("", "192.168.0.2:30090/TCP", ss=ss)
    assert all(p.result.startswith("tc: DNAT to ") for p in v4)


def test_bpf_lb_mode_reaches_the_rendered_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from usproxy.explain import cli

    argv = ["trace", EXTERNAL, "192.168.0.2:30080/TCP", "--services", str(FIXTURES / "nodeport.yaml"),
            "--mode", "bpf", "--node-ip", "192.168.0.2", "--node-name", "node-a"]
    assert cli.main(argv) == 0 and "tc: DSR" not in capsys.readouterr().out
    assert cli.main([*argv, "--bpf-lb-mode", "dsr"]) == 0 and "tc: DSR" in capsys.readouterr().out
