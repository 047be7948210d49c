"""After the first packet: conntrack (or its equivalent), masquerade, the source the backend sees,
and the reply's way back, per mode, on kube-proxy's flow-test Services (tests/explain/flows)."""

from __future__ import annotations

from tests.explain.kube_proxy_flows import flow_packet, flow_set
from usproxy.explain import ipvs, nftables, registry, reply, trace
from usproxy.offload.iptables import rules as iptables

EXTERNAL, POD, NODEPORT = "203.0.113.2", "10.0.0.2", "192.168.0.2:3001/TCP"


def _replies(mode: str, test: str, src: str, dst: str) -> list[str]:
    ss = flow_set(test)
    pkt = flow_packet(ss, src, dst)
    m = registry.by_name(mode)
    return ["\n".join(reply.lines(m, ss, pkt, p)) for p in m.trace(ss, pkt)]


def test_cluster_policy_nodeport_is_masqueraded_in_postrouting_and_un_natted_back() -> None:
    ss = flow_set("TestExternalTrafficPolicyCluster")
    printed = {"iptables": iptables.render(ss), "nftables": nftables.render(ss, "dump"),
               "ipvs": ipvs.render(ss)}
    for mode, view in printed.items():
        for text in _replies(mode, "TestExternalTrafficPolicyCluster", EXTERNAL, NODEPORT):
            rule = next(line for line in text.splitlines() if line.startswith("source NAT"))
            assert rule.rpartition(": ")[2] in view, mode  # the rule quoted is the one printed
            assert "sees the connection from this node's address" in text
            assert f"destination back to {EXTERNAL} (un-SNAT)" in text
            assert "source back to 192.168.0.2:3001 (un-DNAT)" in text


def test_local_policy_keeps_the_client_address_in_every_kernel_mode() -> None:
    for mode in ("iptables", "nftables", "ipvs", "bpf"):
        (text,) = _replies(mode, "TestExternalTrafficPolicyLocal", EXTERNAL, NODEPORT)
        assert f"sees the connection from the client's own address {EXTERNAL}" in text, mode
        assert "no source NAT" in text and "un-SNAT" not in text and "un-DNAT" in text


def test_later_packets_ride_conntrack_or_the_ipvs_table() -> None:
    for mode in ("iptables", "nftables"):
        assert all("only this first packet walked the rules" in t
                   for t in _replies(mode, "TestNodePorts", POD, "172.30.0.41:80/TCP"))
    assert all("its own table (ipvsadm -Lnc)" in t and "Masq rewrote the destination only" in t
               for t in _replies("ipvs", "TestNodePorts", POD, "172.30.0.41:80/TCP"))


def test_ipvs_hairpin_masquerade_is_the_loop_back_rule() -> None:
    (text,) = _replies("ipvs", "TestClusterIPGeneral", "10.180.0.1", "172.30.0.41:80/TCP")
    assert "KUBE-LOOP-BACK" in text and "sees the connection from this node's address" in text


def test_socket_lb_translates_no_packet_and_the_backend_sees_the_client() -> None:
    for text in _replies("bpf", "TestNodePorts", POD, "172.30.0.41:80/TCP"):
        assert "no packet is translated" in text and f"own address {POD}" in text
        assert "getpeername()" in text and "un-DNAT" not in text
    for text in _replies("bpf", "TestClusterIPGeneral", "10.180.0.2", "172.30.0.42:53/UDP"):
        assert "sendmsg()" in text


def test_relay_has_two_connections_and_its_own_flow_table() -> None:
    for src in (POD, EXTERNAL):
        for text in _replies("userspace", "TestExternalTrafficPolicyLocal", src, NODEPORT):
            assert "two connections, no NAT" in text and "flow table" in text
            assert "sees this node's address" in text and src not in text.split("\n", 1)[1]


def test_refusals_say_what_the_client_gets() -> None:
    tcp = ("TestNoEndpointsReject", POD, "172.30.0.41:80/TCP")
    assert _replies("iptables", *tcp) == _replies("nftables", *tcp)
    # iptables `-j REJECT` and nft `reject` default to ICMP port unreachable, not a TCP reset
    assert "ICMP port unreachable" in _replies("iptables", *tcp)[0] and "TCP RST" not in _replies("iptables", *tcp)[0]
    assert "ICMP port unreachable" in _replies("ipvs", "TestNoEndpointsReject", EXTERNAL, NODEPORT)[0]
    assert "ECONNREFUSED" in _replies("bpf", *tcp)[0]
    assert "times out" in _replies("nftables", "TestClusterIPGeneral", "10.180.0.2", "172.30.0.50:80/TCP")[0]


def test_render_has_the_section_for_every_path() -> None:
    ss = flow_set("TestExternalTrafficPolicyCluster")
    pkt = flow_packet(ss, EXTERNAL, NODEPORT)
    text = trace.render(ss, pkt, registry.MODES, detail=True)
    paths = sum(len(m.trace(ss, pkt)) for m in registry.MODES)
    assert paths > len(registry.MODES) and text.count("after the first packet:") == paths
