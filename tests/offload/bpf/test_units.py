"""Pure pieces of the BPF datapath, no kernel: map layout bytes, Maglev tables, slot filling,
ServicePortName parsing, and which ServicePorts the socket LB refuses."""

from __future__ import annotations

import ipaddress
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from tests.offload.bpf.builders import ep, spn, state
from usproxy.offload.bpf import maglev
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.offload.bpf.layout import BackendVal, SvcKey, SvcVal, pack_addr, unpack_addr
from usproxy.offload.bpf.tables import _fill_holes
from usproxy.offload.kernel_datapath import KernelDatapath


def test_addresses_are_v4_mapped_and_ports_network_order() -> None:
    key = SvcKey(ipaddress.ip_address("10.96.0.10"), 53, 17).pack()
    assert key.hex() == "00000000000000000000ffff0a60000a" + "0035" + "0000" + "11000000"
    v6 = ipaddress.ip_address("2001:db8:96::a")
    assert unpack_addr(pack_addr(v6)) == v6
    assert SvcKey.unpack(key) == SvcKey(ipaddress.ip_address("10.96.0.10"), 53, 17)


def test_values_round_trip() -> None:
    assert SvcVal.unpack(SvcVal(3, 7, 10800, 5).pack()) == SvcVal(3, 7, 10800, 5)
    be = BackendVal(ipaddress.ip_address("10.244.1.5"), 8080, 7)
    assert BackendVal.unpack(be.pack()) == be


def test_maglev_is_balanced_and_order_free() -> None:
    names = [f"10.244.1.{i}:8080" for i in range(7)]
    table = maglev.table(names, 1021)
    counts = Counter(table)
    assert len(counts) == 7 and max(counts.values()) - min(counts.values()) <= 1
    assert maglev.table(list(reversed(names)), 1021) == table


def test_maglev_removal_moves_little() -> None:
    names = [f"10.244.{i}.30:8080" for i in range(10)]
    before = [sorted(names)[i] for i in maglev.table(names, 16381)]
    rest = names[:3] + names[4:]
    after = [sorted(rest)[i] for i in maglev.table(rest, 16381)]
    moved = sum(1 for b, a in zip(before, after) if b != a and b != names[3])
    assert moved / 16381 < 0.05  # only the removed endpoint's positions move, plus a few


@given(st.lists(st.integers(1, 40), unique=True, max_size=20), st.data())
def test_fill_holes_keeps_kept_slots(slots: list[int], data: st.DataObject) -> None:
    keep = set(data.draw(st.lists(st.sampled_from(slots), unique=True))) if slots else set()
    new = data.draw(st.lists(st.integers(41, 80), unique=True, max_size=10))
    out = _fill_holes(slots, keep, new)
    assert sorted(out) == sorted(keep | set(new))
    moved = [i for i, b in enumerate(slots) if b in keep and (i >= len(out) or out[i] != b)]
    assert len(moved) <= max(0, len(slots) - len(keep))  # only tail survivors move into holes


def test_unsupported_service_ports() -> None:
    dp = BpfDatapath()
    sctp = spn("s", "", "SCTP")
    assert "SCTP" in (dp.unsupported(state(sctp, "10.96.0.1", 80, [ep("10.244.1.1")])) or "")
    assert "headless" in (dp.unsupported(state(spn("h"), (), 80, [])) or "")
    assert dp.unsupported(state(spn("ok"), "10.96.0.3", 80, [ep("10.244.1.1")])) is None
    assert dp.traffic == frozenset({"local"})


def test_is_a_kernel_datapath_and_takes_the_agents_lb_policy() -> None:
    kd: KernelDatapath = BpfDatapath(selection="roundRobin")
    assert kd.name == "bpf"
    assert BpfDatapath(selection="maglev").selection == "maglev"
    assert BpfDatapath(selection="leastConnections").selection == "random"


def test_load_balancer_ips_are_never_socket_lb_frontends() -> None:
    """loadBalancerSourceRanges cannot be bypassed through the socket LB: it translates ClusterIPs
    only, so a local process's connect() to an LB IP goes on to nftables or the relay, which
    enforce the ranges; a ServicePort with ranges needs no refusal here."""
    lb = state(spn("lb"), "10.96.0.4", 80, [ep("10.244.1.1")], service_type="LoadBalancer", node_port=30080,
               load_balancer_ips=(ipaddress.ip_address("198.51.100.1"),), external_ips=(ipaddress.ip_address("192.0.2.50"),),
               source_ranges=(ipaddress.ip_network("203.0.113.0/25"),))
    dp = BpfDatapath()
    assert dp.unsupported(lb) is None
    wants = dp._wants(lb.service_port.name, lb)
    assert {k.ip for w in wants.values() for k in w.frontends} == {ipaddress.ip_address("10.96.0.4")}


def test_external_reason_names_the_lb_mode() -> None:
    """/services' externalReason (and `usproxy status`): DSR mode says DSR, not SNAT; a Local
    policy keeps the client's address in either mode."""
    from usproxy.offload.kernel_datapath import ALL_TRAFFIC
    from usproxy.offload.bpf.nodeport import HookedInterface

    web = state(spn("web", "http"), "10.96.0.10", 80, [ep("10.244.2.5", node_name="other")],
                node_port=30080, service_type="NodePort")
    local = state(spn("loc", "http"), "10.96.0.11", 80, [ep("10.244.1.5", node_name="node")],
                  node_port=30081, service_type="NodePort", external_traffic_policy="Local")
    reasons = {}
    for mode in ("snat", "dsr"):
        dp = BpfDatapath(lb_mode=mode)
        dp.hooked, dp.traffic = [HookedInterface(2, "eth0", (ipaddress.IPv4Address("192.0.2.10"),))], ALL_TRAFFIC
        reasons[mode] = (dp.external_route(web).reason, dp.external_route(local).reason)
    assert "SNAT to the node when the endpoint is reached" in reasons["snat"][0]
    assert "DSR: an endpoint on another node gets the client's address" in reasons["dsr"][0]
    assert "SNAT to the node when" not in reasons["dsr"][0]
    assert all("client address kept (externalTrafficPolicy Local)" in r[1] for r in reasons.values())
