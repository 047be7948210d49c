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
from usproxy.offload.bpf import loader, nodeport
from usproxy.offload.bpf.datapath import NODEPORT_GROUP, BpfDatapath
from usproxy.offload.bpf.layout import CT_REPLY, F_LOCAL_ONLY, NODEPORT_ANY, CtEntry, SvcKey

V4 = ipaddress.IPv4Address
LINKS = {1: "lo", 2: "eth0", 3: "cbr0", 4: "usproxy0", 5: "eth1"}
ADDRS = [(1, V4("127.0.0.1")), (2, V4("192.0.2.11")), (2, V4("169.254.0.7")), (3, V4("10.244.1.1")),
         (4, V4("10.96.0.10")), (5, V4("198.51.100.4")), (5, V4("198.51.100.5"))]


def test_without_cidrs_every_interface_with_a_non_loopback_address_is_hooked() -> None:
    hooked = nodeport.choose(LINKS, ADDRS, ())
    assert [(h.name, [str(a) for a in h.addresses]) for h in hooked] == [
        ("eth0", ["192.0.2.11"]), ("cbr0", ["10.244.1.1"]), ("eth1", ["198.51.100.4", "198.51.100.5"])]


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
    affinity = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5")], node_port=30080,
                     session_affinity="ClientIP")
    assert NODEPORT_GROUP not in dp._wants(spn("web"), affinity)  # no tc form yet: the relay


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


def test_xdp_runs_where_the_driver_has_native_xdp_and_a_veth_peer_runs_napi() -> None:
    from usproxy.offload.bpf import xdp

    hooked = nodeport.choose(LINKS, ADDRS, ())  # eth0 (2), cbr0 (3), eth1 (5)
    basic, xmit = xdp.XDP_ACT_BASIC, xdp.XDP_ACT_NDO_XMIT
    kinds = {2: "veth", 3: "bridge", 5: ""}
    plan = xdp.plan(hooked, kinds, {2: basic | xmit, 3: 0, 5: basic})
    assert plan.ifindexes == (2, 5)
    assert plan.refused == (("cbr0", "no native XDP in its driver (bridge)"),)
    no_napi = xdp.plan(hooked, kinds, {2: basic, 3: 0, 5: basic})
    assert no_napi.ifindexes == (5,) and no_napi.refused[0][0] == "eth0"  # veth: XDP_TX needs the peer's NAPI
    assert xdp.plan(hooked, kinds, None).ifindexes == ()  # features unreadable: tc only
    assert "XDP (native) on eth0, eth1; tc only on cbr0" in plan.detail({h.ifindex: h.name for h in hooked})
