"""NftablesDatapath's IPv6 table (`ip6 usproxy`) against the real kernel, in a throwaway node
namespace (no agent, no relay), as test_nftables_kernel.py does for the IPv4 table: forwarded TCP
and UDP to IPv6 endpoints without SNAT, the C01 refusal (TCP reset, ICMPv6 port unreachable) for
ClusterIP and NodePort, a dual-stack Service whose two ClusterIPs keep to their own family,
ClientIP affinity and endpoint removal, C24 hairpin masquerade, stale UDP conntrack entries of a
removed endpoint (C03), and read back of the ip6 table by a second datapath.

Topology: IPv6 as tests/offload/ipv6_topology.py adds it (the ClusterIP range routed to the node's
bridge without being local, so a refusal can only come from the table's `reject`); the pods'
servers are its `Responders`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.rules import port_rules
from usproxy.offload.nftables.transaction import Transaction

from tests.netns import Topology, nsexec
from tests.offload.harness import hairpin_ports, nft_list
from tests.offload.ipv6_topology import NODE6, Responders, enable_ipv6, host6, tcp_id, udp6
from tests.offload.helpers import ep, spn, state

pytestmark = pytest.mark.netns

VIP6 = "fd00:96::6a"
WEB6 = spn("web6", "http", ns="ipv6")


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def dp(topology: Topology) -> Iterator[NftablesDatapath]:
    # ClusterIPs routed but not local, as in test_nftables_kernel.py
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/16", "dev", "usbr0")
    enable_ipv6(topology)
    d = NftablesDatapath(netns=topology.node)
    try:
        yield d
    finally:
        d.close()


def pod(topo: Topology, servers: Responders, name: str, v4: str, *v6: str, port: int = 8080) -> str:
    ns = host6(topo, name, v4, *v6)
    servers.start(ns, name, port)
    return ns


def web6(*ips: str, port: int = 8080, **kw: object) -> ServicePortState:
    return state(WEB6, VIP6, 80, [ep(i, port) for i in ips], **kw)


# -- tests --------------------------------------------------------------------------------------
async def test_tcp_and_udp_to_ipv6_clusterip_reach_only_the_endpoints(
        topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    eps = {"be6-a": "fd00:244::61:5", "be6-b": "fd00:244::62:5"}
    pod(topology, servers, "be6-a", "10.244.61.5", eps["be6-a"])
    pod(topology, servers, "be6-b", "10.244.62.5", eps["be6-b"])
    pod(topology, servers, "be6-c", "10.244.63.5", "fd00:244::63:5")  # serving, but no endpoint
    cli6 = "fd00:244::69:10"
    cli = host6(topology, "cli6", "10.244.69.10", cli6)
    dns6 = spn("dns6", proto="UDP", ns="ipv6")
    udp = state(dns6, "fd00:96::6b", 53, [ep(a, 8080) for a in eps.values()])
    await dp.apply({WEB6: web6(*eps.values()), dns6: udp})
    assert "table ip6 usproxy" in nft_list(topology.node)

    seen = [tcp_id(cli, VIP6, 80) for _ in range(60)]
    assert {name for name, _, _ in seen} == {"be6-a", "be6-b"}
    assert all(eps[name] == local for name, local, _ in seen)
    assert {peer for _, _, peer in seen} == {cli6}  # ClusterIP traffic is not SNATed

    names = set()
    for _ in range(30):
        s = udp6(cli)
        try:
            s.settimeout(2)
            s.sendto(b"q", ("fd00:96::6b", 53))
            data, src = s.recvfrom(512)
        finally:
            s.close()
        assert src[:2] == ("fd00:96::6b", 53)  # the kernel reverses the DNAT
        name, peer, payload = data.split(b"|")
        assert peer.decode() == cli6 and payload == b"q"
        names.add(name.decode())
    assert names == {"be6-a", "be6-b"}


async def test_c01_ipv6_without_endpoints_is_refused_then_served(
        topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    pod(topology, servers, "be6-r", "10.244.64.5", "fd00:244::64:5")
    cli6 = "fd00:244::69:20"
    cli = host6(topology, "cli6", "10.244.69.20", cli6)
    np = dict(node_port=30680, service_type="NodePort")
    dns6 = spn("dns6-empty", proto="UDP", ns="ipv6")

    def dns(*ips: str) -> ServicePortState:
        return state(dns6, "fd00:96::6c", 53, [ep(i, 8080) for i in ips])

    await dp.apply({WEB6: web6(**np), dns6: dns()})  # type: ignore[arg-type]
    for addr, port in ((VIP6, 80), (NODE6, 30680)):
        for _ in range(10):
            with pytest.raises(ConnectionRefusedError):  # TCP reset from `reject`
                tcp_id(cli, addr, port)
    s = udp6(cli)
    try:
        s.connect(("fd00:96::6c", 53))
        s.settimeout(2)
        for _ in range(5):
            s.send(b"q")
            with pytest.raises(ConnectionRefusedError):  # ICMPv6 port unreachable
                s.recv(512)
    finally:
        s.close()

    await dp.apply({WEB6: web6("fd00:244::64:5", **np), dns6: dns("fd00:244::64:5")})  # type: ignore[arg-type]
    assert {tcp_id(cli, VIP6, 80) for _ in range(10)} == {("be6-r", "fd00:244::64:5", cli6)}
    # NodePort traffic (externalTrafficPolicy Cluster) is masqueraded to the node's address
    assert {tcp_id(cli, NODE6, 30680) for _ in range(10)} == {("be6-r", "fd00:244::64:5", NODE6)}
    s = udp6(cli)
    try:
        s.settimeout(2)
        s.sendto(b"q", ("fd00:96::6c", 53))
        data, src = s.recvfrom(512)
        assert src[:2] == ("fd00:96::6c", 53) and data.startswith(b"be6-r|")
    finally:
        s.close()

    await dp.apply({WEB6: web6(**np)})  # type: ignore[arg-type]
    with pytest.raises(ConnectionRefusedError):
        tcp_id(cli, VIP6, 80)


async def test_dual_stack_service_each_clusterip_keeps_to_its_family(
        topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    # every pod serves both families; the Service's IPv4 endpoints are a and b, its IPv6 ones b and c
    addrs = {"ds-a": ("10.244.65.5", "fd00:244::65:5"), "ds-b": ("10.244.66.5", "fd00:244::66:5"),
             "ds-c": ("10.244.67.5", "fd00:244::67:5")}
    for name, (v4, v6) in addrs.items():
        pod(topology, servers, name, v4, v6)
    cli = host6(topology, "cli6", "10.244.69.30", "fd00:244::69:30")
    vip4, vip6 = "10.96.60.60", "fd00:96::6d"
    ds = spn("dual", "http", ns="ipv6")
    eps = [ep(addrs["ds-a"][0]), ep(addrs["ds-b"][0]), ep(addrs["ds-b"][1]), ep(addrs["ds-c"][1])]
    st = state(ds, vip4, 80, eps, cluster_ips=(ipaddress.ip_address(vip4), ipaddress.ip_address(vip6)))
    await dp.apply({ds: st})
    over4 = [tcp_id(cli, vip4, 80) for _ in range(40)]
    over6 = [tcp_id(cli, vip6, 80) for _ in range(40)]
    assert {(n, local) for n, local, _ in over4} == {("ds-a", addrs["ds-a"][0]), ("ds-b", addrs["ds-b"][0])}
    assert {(n, local) for n, local, _ in over6} == {("ds-b", addrs["ds-b"][1]), ("ds-c", addrs["ds-c"][1])}
    assert {p for _, _, p in over4} == {"10.244.69.30"} and {p for _, _, p in over6} == {"fd00:244::69:30"}
    # each family's table holds only its own family's ClusterIP and endpoints
    v4_table = nsexec(topology.node, "nft", "list", "table", "ip", "usproxy").stdout
    v6_table = nsexec(topology.node, "nft", "list", "table", "ip6", "usproxy").stdout
    assert vip6 not in v4_table and "fd00:244::" not in v4_table
    assert vip4 not in v6_table and "10.244." not in v6_table


async def test_client_ip_affinity_over_ipv6_and_endpoint_removal(
        topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    eps = {"af-1": "fd00:244::71:5", "af-2": "fd00:244::72:5"}
    for i, (name, a) in enumerate(eps.items()):
        pod(topology, servers, name, f"10.244.7{i + 1}.5", a)
    clients = [f"fd00:244::79:{10 + i:x}" for i in range(24)]
    cli = host6(topology, "cli6", "10.244.79.10", *clients)

    def sticky(*ips: str) -> ServicePortState:
        return web6(*ips, session_affinity="ClientIP", affinity_timeout=60)

    await dp.apply({WEB6: sticky(*eps.values())})
    first = {c: tcp_id(cli, VIP6, 80, src=c) for c in clients}
    assert all(peer == c for c, (_, _, peer) in first.items())
    for c in clients:
        assert {tcp_id(cli, VIP6, 80, src=c) for _ in range(4)} == {first[c]}
    assert {name for name, _, _ in first.values()} == set(eps)  # 24 clients: both are chosen
    # the endpoint client 0 is pinned to goes away: every client now gets the other one
    pinned = first[clients[0]][0]
    (left,) = set(eps) - {pinned}
    await dp.apply({WEB6: sticky(eps[left])})
    assert {tcp_id(cli, VIP6, 80, src=c)[0] for c in clients for _ in range(2)} == {left}
    # and back to both without affinity: new connections spread over both again
    await dp.apply({WEB6: web6(*eps.values())})
    assert {tcp_id(cli, VIP6, 80, src=clients[0])[0] for _ in range(40)} == set(eps)


async def test_c24_ipv6_hairpin_is_masqueraded(topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    me = "fd00:244::74:5"
    ns = pod(topology, servers, "hp6", "10.244.74.5", me)
    hairpin_ports(topology)
    await dp.apply({WEB6: web6(me)})
    assert f"{me} . {me}" in nsexec(topology.node, "nft", "list", "set", "ip6", "usproxy", "hairpin").stdout
    seen = {tcp_id(ns, VIP6, 80) for _ in range(20)}
    assert seen == {("hp6", me, NODE6)}  # reached itself, from the node's address


async def test_c03_ipv6_udp_flow_leaves_a_removed_endpoint(
        topology: Topology, dp: NftablesDatapath, servers: Responders) -> None:
    pod(topology, servers, "st-a", "10.244.75.5", "fd00:244::75:5", port=8125)
    pod(topology, servers, "st-b", "10.244.76.5", "fd00:244::76:5", port=8125)
    cli = host6(topology, "cli6", "10.244.79.40", "fd00:244::79:40")
    statsd = spn("statsd6", proto="UDP", ns="ipv6")

    def st(*ips: str) -> ServicePortState:
        return state(statsd, "fd00:96::6e", 8125, [ep(i, 8125) for i in ips])

    s = udp6(cli, ("fd00:244::79:40", 41600))  # one flow: the same 5-tuple throughout
    s.connect(("fd00:96::6e", 8125))
    s.settimeout(2)
    try:
        def ask() -> str:
            s.send(b"m:1|c")
            return s.recv(512).split(b"|")[0].decode()

        await dp.apply({statsd: st("fd00:244::75:5")})
        assert {ask() for _ in range(5)} == {"st-a"}
        rows = [r for r in dp.flows_view() if r["service"] == statsd.key()]  # IPv6 kernel flows in /flows
        assert [(r["original"]["dst"], r["endpoint"]) for r in rows] == [("[fd00:96::6e]:8125", "[fd00:244::75:5]:8125")]
        await dp.apply({statsd: st("fd00:244::76:5")})
        await dp.clear_stale({statsd: frozenset({ep("fd00:244::75:5", 8125)})})
        # st-a still runs: only the conntrack entry's removal moves the flow to st-b
        assert {ask() for _ in range(5)} == {"st-b"}
    finally:
        s.close()


async def test_read_back_of_the_ip6_table(topology: Topology, dp: NftablesDatapath) -> None:
    sticky = state(spn("sticky6", ns="ipv6"), "fd00:96::70", 80, [ep("fd00:244::81:5"), ep("fd00:244::82:5")],
                   session_affinity="ClientIP", affinity_timeout=30)
    dual = state(spn("dual6", "dns", "UDP", ns="ipv6"), "", 53,
                 [ep("10.244.81.5", 53), ep("fd00:244::81:5", 53), ep("fd00:244::83:5", 53)],
                 cluster_ips=(ipaddress.ip_address("10.96.60.61"), ipaddress.ip_address("fd00:96::71")))
    states = {WEB6: web6("fd00:244::81:5", "fd00:244::82:5", "fd00:244::83:5", node_port=30681,
                         service_type="NodePort", external_ips=["fd00:244::1:50"]),
              sticky.service_port.name: sticky, dual.service_port.name: dual,
              spn("empty6", ns="ipv6"): state(spn("empty6", ns="ipv6"), "fd00:96::72", 80, [])}
    await dp.apply(states)
    again = NftablesDatapath(netns=topology.node)
    try:
        found = await again.read_back()
        assert found == {n: tuple(sorted({*s.cluster_endpoints, *s.external_endpoints})) for n, s in states.items()}
        assert again.tables[6].rules == dp.tables[6].rules  # frontends, slot order, affinity, masquerade
        assert again.tables[6].hairpin == dp.tables[6].hairpin
        tx = Transaction(again.tables[6])
        for n, s in states.items():
            tx.update(tx.state.rules.get(n), port_rules(s, 6, tx.state.rules.get(n)))
        assert [c for c in tx.commands() if c.obj == "element"] == []
        before = nft_list(topology.node)
        await again.apply(states)
        assert nft_list(topology.node) == before
    finally:
        again.close()
