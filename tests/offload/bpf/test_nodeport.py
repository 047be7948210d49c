"""NodePort at tc, below the three-node test (tests/cluster/test_tc_nodeport.py): which interfaces
are hooked, the conntrack entry bytes, the NodePort group a ServicePort gets, and the tcx links
the loader attaches, swaps, and detaches (in a throwaway netns, cgroup and pin root)."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.bpf.builders import ep, spn, state
from tests.offload.bpf.conftest import Env
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader, nodeport, view
from usproxy.offload.bpf.tables import Group
from usproxy.offload.bpf.datapath import LB_GROUP, NODEPORT_GROUP, BpfDatapath
from usproxy.offload.bpf.layout import (CT_MAPS, CT_PENDING, CT_REPLY, F_AFFINITY, F_DROP_EMPTY, F_LB_IPS, F_LOCAL_ONLY,
                                        F_SOURCE_RANGES, F_TC_ONLY, NODEPORT_ANY, CtEntry, SvcKey, SvcVal, pack_peer_net,
                                        pack_src_range, unpack_peer_net, unpack_src_range)

V4 = ipaddress.IPv4Address
LINKS = {1: "lo", 2: "eth0", 3: "cbr0", 4: "usproxy0", 5: "eth1"}
ADDRS = [(1, V4("127.0.0.1")), (2, V4("192.0.2.11")), (2, V4("169.254.0.7")), (3, V4("10.244.1.1")),
         (4, V4("10.96.0.10")), (5, V4("198.51.100.4")), (5, V4("198.51.100.5"))]


def test_without_cidrs_every_interface_with_a_non_loopback_address_is_hooked() -> None:
    hooked = nodeport.choose(LINKS, ADDRS, ())
    assert [(h.name, [str(a) for a in h.addresses]) for h in hooked] == [
        ("eth0", ["192.0.2.11"]), ("cbr0", ["10.244.1.1"]), ("eth1", ["198.51.100.4", "198.51.100.5"])]


def test_hooked_interfaces_follow_their_addresses_and_new_ones_are_named() -> None:
    hooked = nodeport.choose(LINKS, ADDRS, ())
    later = [(2, V4("192.0.2.11")), (2, V4("192.0.2.91")), (5, V4("198.51.100.4")), (6, V4("203.0.113.9"))]
    now = nodeport.choose({**LINKS, 6: "eth2"}, later, ())
    followed = nodeport.follow(hooked, now)
    assert [(h.name, [str(a) for a in h.addresses]) for h in followed] == [
        ("eth0", ["192.0.2.11", "192.0.2.91"]), ("cbr0", []), ("eth1", ["198.51.100.4"])]
    assert [h.name for h in nodeport.unhooked(followed, now)] == ["eth2"]  # no tc program until a restart


def test_cidrs_choose_the_interfaces_as_nodeport_addresses_choose_addresses() -> None:
    cidrs = (ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("198.51.100.5/32"))
    hooked = nodeport.choose(LINKS, ADDRS, cidrs)
    assert [(h.ifindex, h.addresses) for h in hooked] == [(2, (V4("192.0.2.11"),)), (5, (V4("198.51.100.5"),))]
    assert nodeport.choose(LINKS, ADDRS, (ipaddress.ip_network("127.0.0.0/8"),))[0].name == "lo"


def test_ct_entry_reads_the_c_layout() -> None:
    key = socket.inet_aton("10.244.2.10") + socket.inet_aton("192.0.2.11") + struct.pack("!HHBB", 8080, 40000, 6, 1) + b"\0\0"
    val = (socket.inet_aton("192.0.2.11") + socket.inet_aton("203.0.113.10") + struct.pack("!HH", 30080, 51000)
           + struct.pack("<IIIQQQ", 7, 9, 1, 100, 200, 3))
    e = CtEntry.unpack(key, val)
    assert (str(e.saddr), e.sport, str(e.daddr), e.dport, e.proto, e.direction) == ("10.244.2.10", 8080, "192.0.2.11", 40000, 6, CT_REPLY)
    assert (str(e.nat_saddr), e.nat_sport, str(e.nat_daddr), e.nat_dport) == ("192.0.2.11", 30080, "203.0.113.10", 51000)
    assert (e.svc_id, e.backend_id, e.flags, e.created, e.last, e.packets) == (7, 9, 1, 100, 200, 3)


def test_a_pending_entry_reads_as_not_confirmed_and_shows_as_new() -> None:
    """usp_ct_new's values are struct ct_new_val: a struct ct_val, then the SYN-ACK's sequence."""
    key = socket.inet_aton("203.0.113.10") + socket.inet_aton("192.0.2.11") + struct.pack("!HHBB", 51000, 30080, 6, 0) + b"\0\0"
    val = (b"\0" * 4 + socket.inet_aton("10.244.2.10") + struct.pack("!HH", 0, 8080)
           + struct.pack("<IIIQQQ", 7, 9, 0, 100, 200, 3) + struct.pack("<II", 12345, 0))
    assert len(val) == CT_MAPS[CT_PENDING]
    e = CtEntry.unpack(key, val, confirmed=False)
    assert (str(e.nat_daddr), e.nat_dport, e.confirmed) == ("10.244.2.10", 8080, False)
    assert nodeport.ct_row(e, "default/web:http", 300)["state"] == "NEW"
    assert nodeport.ct_row(CtEntry.unpack(key, val[:48]), "default/web:http", 300)["state"] == "NAT"


def test_dsr_peers_are_the_nodeport_cidrs_and_the_networks_of_the_nodeport_addresses() -> None:
    """An interface's addresses come with their networks (netlink's prefix length): the node
    networks a DSR option's NodePort address must be in (dsr.h)."""
    addrs = [(2, ipaddress.IPv4Interface("192.0.2.12/24")), (3, ipaddress.IPv4Interface("10.244.2.1/24")),
             (3, ipaddress.IPv4Interface("10.244.2.2/24")), (1, ipaddress.IPv4Interface("127.0.0.1/8"))]
    hooked = nodeport.choose(LINKS, addrs, ())
    assert [(h.name, h.addresses, h.networks) for h in hooked] == [
        ("eth0", (V4("192.0.2.12"),), (ipaddress.IPv4Network("192.0.2.0/24"),)),
        ("cbr0", (V4("10.244.2.1"), V4("10.244.2.2")), (ipaddress.IPv4Network("10.244.2.0/24"),))]
    cidrs = (ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("2001:db8::/64"))
    assert [str(n) for n in nodeport.dsr_peers(hooked, cidrs)] == ["10.244.2.0/24", "192.0.2.0/24", "198.51.100.0/24"]
    assert [str(n) for n in nodeport.dsr_peers(nodeport.follow(hooked, hooked[:1]), ())] == ["192.0.2.0/24"]
    assert unpack_peer_net(pack_peer_net(ipaddress.IPv4Network("192.0.2.0/24"))) == ipaddress.IPv4Network("192.0.2.0/24")


@pytest.mark.parametrize("etp", ["Cluster", "Local"])
def test_a_nodeport_gets_a_group_at_any_address_when_tc_serves(etp: str) -> None:
    dp = BpfDatapath(nodeport_cidrs=())
    st = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5", node_name="node"), ep("10.244.2.5")],
               node_port=30080, external_traffic_policy=etp)
    assert NODEPORT_GROUP not in dp._wants(spn("web"), st)  # not probed: the relay keeps NodePorts
    dp.traffic = frozenset({"local", "forwarded"})
    want = dp._wants(spn("web"), st)[NODEPORT_GROUP]
    assert want.frontends == frozenset({SvcKey(NODEPORT_ANY, 30080, 6)})
    local = ["10.244.1.5"] if etp == "Local" else ["10.244.1.5", "10.244.2.5"]
    assert [str(ip) for ip, _ in want.endpoints] == local  # eTP=Local: only this node's
    assert bool(want.flags & F_LOCAL_ONLY) == (etp == "Local")
    assert want.flags & F_TC_ONLY  # never a socket LB frontend


def tc_datapath() -> BpfDatapath:
    dp = BpfDatapath(nodeport_cidrs=())
    dp.traffic = frozenset({"local", "forwarded"})
    dp.hooked = [nodeport.HookedInterface(2, "eth0", (V4("192.0.2.11"),))]
    return dp


def test_lb_ips_and_external_ips_get_tc_groups_with_source_ranges_for_lb_ips_only() -> None:
    st = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5", node_name="node")], node_port=30080,
               service_type="LoadBalancer", external_ips=(V4("198.51.100.4"), ipaddress.ip_address("2001:db8::4")),
               load_balancer_ips=(V4("198.51.100.1"),), source_ranges=(ipaddress.ip_network("203.0.113.0/25"),))
    wants = tc_datapath()._wants(spn("web"), st)
    ext, lb = wants[NODEPORT_GROUP], wants[LB_GROUP]
    assert ext.frontends == frozenset({SvcKey(NODEPORT_ANY, 30080, 6), SvcKey(V4("198.51.100.4"), 80, 6)})  # IPv4 only
    assert not ext.flags & F_SOURCE_RANGES and not ext.sources  # NodePorts and externalIPs unfiltered
    assert lb.frontends == frozenset({SvcKey(V4("198.51.100.1"), 80, 6)})
    assert lb.flags & F_SOURCE_RANGES and lb.flags & F_TC_ONLY and lb.flags & F_LB_IPS
    assert lb.sources == (ipaddress.ip_network("203.0.113.0/25"),)
    assert ext.endpoints == lb.endpoints == ((V4("10.244.1.5"), 8080),)


def test_source_ranges_holding_a_node_address_also_allow_the_lb_ips() -> None:
    st = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5")], service_type="LoadBalancer",
               load_balancer_ips=(V4("198.51.100.1"),), source_ranges=(ipaddress.ip_network("192.0.2.0/24"),))
    lb = tc_datapath()._wants(spn("web"), st)[LB_GROUP]
    assert [str(n) for n in lb.sources] == ["192.0.2.0/24", "198.51.100.1/32"]  # allowed_sources, as nftables


def test_affinity_and_no_endpoint_verdicts_of_tc_groups() -> None:
    dp = tc_datapath()
    affinity = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5")], node_port=30080,
                     session_affinity="ClientIP")
    assert dp._wants(spn("web"), affinity)[NODEPORT_GROUP].flags & F_AFFINITY
    remote = state(spn("web"), "10.96.0.10", 80, [ep("10.244.2.5", node_name="other")], node_port=30080,
                   external_traffic_policy="Local")
    assert dp._wants(spn("web"), remote)[NODEPORT_GROUP].flags & F_DROP_EMPTY  # kube-proxy drops
    for policy in ("Local", "Cluster"):  # no usable endpoint anywhere: kube-proxy refuses
        none = state(spn("web"), "10.96.0.10", 80, [ep("10.244.2.5", ready=False, serving=False)],
                     node_port=30080, external_traffic_policy=policy)
        want = dp._wants(spn("web"), none)[NODEPORT_GROUP]
        assert not want.endpoints and not want.flags & F_DROP_EMPTY


def test_the_map_view_marks_tc_groups_with_their_admission_flags() -> None:
    g = Group("default/web:http/TCP", 3, {SvcKey(V4("198.51.100.1"), 80, 6)},
              SvcVal(0, 3, 0, F_TC_ONLY | F_LB_IPS | F_SOURCE_RANGES | F_LOCAL_ONLY | F_DROP_EMPTY))
    head = view.group_lines({3: g}, {})[0]
    assert head.endswith(" tc=local-only,source-ranges,drop-if-empty"), head
    g.val = SvcVal(0, 3, 0, 0)
    assert " tc" not in view.group_lines({3: g}, {})[0]  # a ClusterIP group


def test_source_range_keys_match_the_c_layout() -> None:
    raw = pack_src_range(7, ipaddress.IPv4Network("203.0.113.0/25"))
    assert raw == struct.pack("<II", 57, 7) + bytes([203, 0, 113, 0])
    assert unpack_src_range(raw) == (7, ipaddress.IPv4Network("203.0.113.0/25"))


def tcx(ns: str, ifname: str) -> tuple[list[int], list[int]]:
    with inside(ns):
        ifindex = socket.if_nametoindex(ifname)
        return bpf.prog_query(ifindex, bpf.BPF_TCX_INGRESS), bpf.prog_query(ifindex, bpf.BPF_TCX_EGRESS)


def open_in(ns: str, lb: loader.SockLB) -> None:
    with inside(ns):
        lb.open()
    lb.close()


@pytest.mark.netns
def test_tc_links_are_pinned_swapped_and_detached(bpf_env: Env, topology: Topology) -> None:
    ns = topology.node
    nsexec(ns, "ip", "link", "add", "tcx0", "type", "veth", "peer", "name", "tcx1")
    with inside(ns):
        ifindex = socket.if_nametoindex("tcx0")
    pins = loader.PinLayout(bpf_env.pin_root)
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,)))  # ifindexes are per netns
    ingress, egress = tcx(ns, "tcx0")
    assert len(ingress) == 1 and len(egress) == 1
    assert (pins.links / f"usp_tc_ingress@{ifindex}").exists()
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,)))  # an agent restart: swapped in place
    swapped = tcx(ns, "tcx0")
    assert len(swapped[0]) == 1 and swapped[0] != ingress
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup))  # tc no longer asked for: its links go
    assert tcx(ns, "tcx0") == ([], [])
    assert not list(pins.links.glob("*@*"))


@pytest.mark.netns
def test_tc_attach_probe_attaches_detaches_and_reports_a_failure(topology: Topology) -> None:
    ns = topology.node
    nsexec(ns, "ip", "link", "add", "tcp0", "type", "veth", "peer", "name", "tcp1")
    with inside(ns):
        ifindex = socket.if_nametoindex("tcp0")
        loader.probe_tc_attach(ifindex)
        assert bpf.prog_query(ifindex, bpf.BPF_TCX_INGRESS) == []  # detached again
        with pytest.raises(bpf.BpfError):
            loader.probe_tc_attach(ifindex + 1000)  # no such interface: the probe says no


def test_xdp_runs_where_the_driver_has_native_xdp_and_a_veth_peer_runs_xdp() -> None:
    from usproxy.offload.bpf import xdp

    hooked = nodeport.choose(LINKS, ADDRS, ())  # eth0 (2), cbr0 (3), eth1 (5)
    basic, xmit = xdp.XDP_ACT_BASIC, xdp.XDP_ACT_NDO_XMIT
    kinds = {2: "veth", 3: "bridge", 5: ""}
    plan = xdp.plan(hooked, kinds, {2: basic | xmit, 3: 0, 5: basic}, {2: True})
    assert plan.ifindexes == (2, 5)
    assert plan.refused == (("cbr0", "no native XDP in its driver (bridge)"),)
    # veth: XDP_TX frames are polled at the peer only when it runs XDP; GRO alone gives NDO_XMIT
    gro = xdp.plan(hooked, kinds, {2: basic | xmit, 3: 0, 5: basic}, {2: False})
    assert gro.ifindexes == (5,) and gro.refused[0] == (
        "eth0", "veth whose peer runs GRO but no XDP program: frames sent with XDP_TX would wait unpolled in the peer's ring")
    no_napi = xdp.plan(hooked, kinds, {2: basic, 3: 0, 5: basic}, {2: False})
    assert no_napi.ifindexes == (5,) and no_napi.refused[0] == (
        "eth0", "veth whose peer runs no XDP program: frames sent with XDP_TX would be dropped")
    unread = xdp.plan(hooked, kinds, {2: basic | xmit, 3: 0, 5: basic}, {})
    assert unread.ifindexes == (5,) and "peer is unreadable" in unread.refused[0][1]
    assert xdp.plan(hooked, kinds, None, {2: True}).ifindexes == ()  # features unreadable: tc only
    assert "XDP (native) on eth0, eth1; tc only on cbr0" in plan.detail({h.ifindex: h.name for h in hooked})
