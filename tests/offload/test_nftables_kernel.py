"""NftablesDatapath against the real kernel in a throwaway node namespace (no agent, no relay):
forwarded TCP/UDP to endpoints, endpoint changes, C01 refusal, C03 UDP conntrack clearing, C17
distribution and churn, ClientIP affinity, lb-policy roundRobin, C24 hairpin, NodePort masquerade, an atomic failed
transaction, read back after a restart, and cleanup."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from scipy.stats import chisquare

from usproxy.offload.nftables.declaration import probe_nftables
from usproxy.core.datapath import ServicePortState
from usproxy.util.errors import OffloadError
from usproxy.offload import kernel_conntrack
from usproxy.offload.nftables.client import NftClient
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.rules import port_rules
from usproxy.offload.nftables.transaction import Transaction

from tests.netns import Topology, nsexec
from tests.offload.harness import (
    Pods,
    conntrack,
    hairpin_ports,
    nft_list,
    tcp_name,
    tcp_peer_name,
    udp_socket,
    wait_listening,
)
from tests.offload.helpers import ep, spn, state

pytestmark = pytest.mark.netns

VIP = "10.96.10.10"
WEB = spn("web", "http")


@pytest.fixture
def dp(topology: Topology) -> Iterator[NftablesDatapath]:
    # ClusterIPs routed but not local: what is not DNATed or rejected by the table goes nowhere,
    # so a refusal can only come from the `reject` rules
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/16", "dev", "usbr0")
    d = NftablesDatapath(netns=topology.node)
    try:
        yield d
    finally:
        d.close()


def web(*ips: str, port: int = 8080, **kw: object) -> ServicePortState:
    return state(WEB, VIP, 80, [ep(i, port) for i in ips], **kw)


async def test_forwarded_tcp_and_udp_reach_every_endpoint(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    wait_listening(cli, "10.244.2.5", 8080)
    udp = state(spn("dns", proto="UDP"), "10.96.10.11", 53, [ep("10.244.1.5"), ep("10.244.2.5")])
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5"), udp.service_port.name: udp})
    names = Counter(tcp_name(cli, VIP, 80) for _ in range(60))
    assert set(names) == {"be-a", "be-b"}
    seen = set()
    for _ in range(40):
        s = udp_socket(cli)
        s.settimeout(2)
        s.sendto(b"q", ("10.96.10.11", 53))
        data, src = s.recvfrom(512)
        s.close()
        assert src == ("10.96.10.11", 53)  # the kernel reverses the NAT (C06 in offload mode)
        seen.add(data.split(b"|")[0])
    assert seen == {b"be-a", b"be-b"}


async def test_endpoint_changes_take_effect_and_cost_only_the_change(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    for i in (1, 2, 3):
        pods.add(f"be-{i}", f"10.244.{i}.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.3.5", 8080)
    others = {spn(f"s{i}"): state(spn(f"s{i}"), f"10.96.20.{i}", 80, [ep("10.244.1.5")]) for i in range(1, 50)}
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5"), **others})
    tx = Transaction(dp.tables[4])
    tx.update(dp.tables[4].rules[WEB], port_rules(web("10.244.1.5", "10.244.3.5"), 4, dp.tables[4].rules[WEB]))
    elems = [c for c in tx.commands() if c.obj == "element"]
    assert sum(len(c.elems) for c in elems) == 4  # slot replaced in place, hairpin -1 +1
    await dp.apply({WEB: web("10.244.1.5", "10.244.3.5")})
    assert {tcp_name(cli, VIP, 80) for _ in range(40)} == {"be-1", "be-3"}
    await dp.apply({WEB: web("10.244.3.5")})
    assert {tcp_name(cli, VIP, 80) for _ in range(10)} == {"be-3"}


async def test_c01_no_endpoints_refused_then_served(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    np = dict(node_port=30080, service_type="NodePort")
    await dp.apply({WEB: web(**np)})  # type: ignore[arg-type]
    for addr, port in ((VIP, 80), ("192.0.2.10", 30080)):
        for _ in range(20):
            with pytest.raises(ConnectionRefusedError):
                tcp_name(cli, addr, port, timeout=3)
    await dp.apply({WEB: web("10.244.1.5", **np)})  # type: ignore[arg-type]
    assert {tcp_name(cli, a, p) for a, p in ((VIP, 80), ("192.0.2.10", 30080)) for _ in range(20)} == {"be-a"}
    await dp.apply({WEB: web(**np)})  # type: ignore[arg-type]
    with pytest.raises(ConnectionRefusedError):
        tcp_name(cli, VIP, 80)


@pytest.mark.parametrize("filtered_max", [kernel_conntrack.FILTERED_MAX, 0], ids=["kernel-filtered", "full-dump"])
async def test_c03_udp_one_way_sender_follows_endpoint_changes(topology: Topology, dp: NftablesDatapath, pods: Pods,
                                                               filtered_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_conntrack, "FILTERED_MAX", filtered_max)  # both ways of finding stale entries
    pods.add("be-a", "10.244.1.7", port=8125, mute=True)
    pods.add("be-b", "10.244.2.8", port=8125, mute=True)
    cli = topology.add_host("cli", "10.244.9.10")
    statsd = spn("statsd", proto="UDP", ns="monitoring")

    def st(*ips: str) -> ServicePortState:
        return state(statsd, "10.96.20.20", 8125, [ep(i, 8125) for i in ips])

    # Linux rate-limits ICMP errors per destination (1/s after a burst of 6); C03 counts every refusal
    nsexec(topology.node, "sysctl", "-qw", "net.ipv4.icmp_ratelimit=0")
    s = udp_socket(cli, ("10.244.9.10", 41000))
    s.connect(("10.96.20.20", 8125))
    s.settimeout(0.2)

    def burst(n: int = 20) -> int:
        refused = 0
        for _ in range(n):
            try:
                s.send(b"m:1|c")
                s.recv(64)
            except ConnectionRefusedError:
                refused += 1
            except TimeoutError:
                pass
        return refused

    await dp.apply({statsd: st()})
    assert burst() >= 18
    await dp.apply({statsd: st("10.244.1.7")})
    burst(20)
    time.sleep(0.3)
    a_before = pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0)
    assert a_before >= 19  # delivered from the first datagrams after the change
    await dp.apply({statsd: st()})
    await dp.clear_stale({statsd: frozenset({ep("10.244.1.7", 8125)})})
    assert burst() >= 18
    time.sleep(0.3)
    assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) == a_before
    await dp.apply({statsd: st("10.244.2.8")})
    burst(20)
    time.sleep(0.3)
    assert pods.counts("be-b", "udp", 8125).get("10.244.2.8", 0) >= 19
    assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) == a_before
    s.close()


BATCH = 500  # datagrams in flight at once, below netdev_max_backlog


async def test_c17_uniform_over_five_endpoints_and_after_churn(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    ips = [f"10.244.{i}.30" for i in range(1, 7)]
    pods.add("be", *ips, port=8081, mute=True)
    cli = topology.add_host("cli", "10.244.9.10", "10.244.9.11", "10.244.9.12")
    spread = spn("spread", "u", "UDP")

    def st(chosen: list[str]) -> ServicePortState:
        return state(spread, "10.96.120.120", 81, [ep(i, 8081) for i in chosen])

    def total() -> int:
        return sum(pods.counts("be", "udp", 8081).values())

    def settle(target: int) -> None:
        """Wait until `target` datagrams are counted, or the count has stopped rising for 2 s
        (a datagram the kernel dropped on a busy machine never arrives)."""
        last, since = total(), time.monotonic()
        while last < target and time.monotonic() - since < 2:
            time.sleep(0.05)
            now = total()
            if now != last:
                last, since = now, time.monotonic()

    def flows(n: int, base_port: int) -> Counter[str]:
        """n new UDP flows (distinct source address and port), sent in batches that both the
        endpoint's socket buffer and the kernel's per-CPU input queue (netdev_max_backlog, 1000:
        each datagram crosses two veths) hold. On a loaded machine the kernel may still drop a few
        datagrams (a drop does not depend on the endpoint chosen); the shares are of those counted,
        and at most 1% may be missing."""
        before = Counter(pods.counts("be", "udp", 8081))
        start = sum(before.values())
        for batch in range(0, n, BATCH):
            for k in range(batch, min(n, batch + BATCH)):
                s = udp_socket(cli, (f"10.244.9.{10 + k % 3}", base_port + k // 3))
                s.sendto(b"x", ("10.96.120.120", 81))
                s.close()
            settle(start + min(n, batch + BATCH))
        got = Counter(pods.counts("be", "udp", 8081)) - before
        assert sum(got.values()) >= 0.99 * n, f"{sum(got.values())} of {n} flows counted"
        return got

    await dp.apply({spread: st(ips[:5])})
    got = flows(30000, 20000)
    counts = [got[i] for i in ips[:5]]
    shares = [c / sum(counts) for c in counts]
    assert all(0.19 <= f <= 0.21 for f in shares), counts
    assert chisquare(counts).pvalue >= 0.001
    await dp.apply({spread: st([*ips[:2], ips[5], *ips[3:5]])})  # be-3 replaced by be-6
    got = flows(30000, 40000)
    assert got[ips[2]] == 0
    assert 0.15 <= got[ips[5]] / sum(got.values()) <= 0.25


async def test_client_ip_affinity_is_sticky_per_client(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    for i in (1, 2, 3):
        pods.add(f"be-{i}", f"10.244.{i}.20")
    clients = [f"10.244.9.{10 + i}" for i in range(30)]
    cli = topology.add_host("cli", *clients)
    wait_listening(cli, "10.244.3.20", 8080)
    sticky = web("10.244.1.20", "10.244.2.20", "10.244.3.20", session_affinity="ClientIP", affinity_timeout=60)
    await dp.apply({WEB: sticky})
    first = {c: tcp_name(cli, VIP, 80, src=c) for c in clients}
    for c in clients[:10]:
        assert {tcp_name(cli, VIP, 80, src=c) for _ in range(5)} == {first[c]}
    assert len(set(first.values())) == 3
    # removing the pinned endpoint purges its affinity (C16 step 3)
    pinned = first[clients[0]]
    left = [a for a in ("10.244.1.20", "10.244.2.20", "10.244.3.20") if not a.startswith(f"10.244.{pinned[-1]}.")]
    await dp.apply({WEB: web(*left, session_affinity="ClientIP", affinity_timeout=60)})
    after = {tcp_name(cli, VIP, 80, src=clients[0]) for _ in range(10)}
    assert len(after) == 1 and pinned not in after


async def test_round_robin_annotation_rotates_in_the_kernel(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    for i in (1, 2, 3):
        pods.add(f"be-{i}", f"10.244.{i}.25")
    cli = topology.add_host("cli", "10.244.9.25")
    wait_listening(cli, "10.244.3.25", 8080)
    await dp.apply({WEB: web("10.244.1.25", "10.244.2.25", "10.244.3.25", lb_policy="roundRobin")})
    names = [tcp_name(cli, VIP, 80) for _ in range(12)]
    assert len(set(names[:3])) == 3 and names == names[:3] * 4  # each endpoint in turn, never twice in a row
    # an endpoint leaves: the two left alternate
    await dp.apply({WEB: web("10.244.1.25", "10.244.3.25", lb_policy="roundRobin")})
    after = [tcp_name(cli, VIP, 80) for _ in range(6)]
    assert len(set(after)) == 2 and after == after[:2] * 3


def test_check_probes_the_kernel_as_the_agent_does(topology: Topology, dp: NftablesDatapath) -> None:
    cap = probe_nftables(NftClient(topology.node))
    assert cap.available and dp.probe().detail.startswith(cap.detail)
    assert "usproxy-probe" not in nft_list(topology.node)  # added and deleted in one transaction


async def test_kernel_flows_carry_byte_counts_once_accounting_is_on(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    pods.add("be-1", "10.244.1.26")
    cli = topology.add_host("cli", "10.244.9.26")
    wait_listening(cli, "10.244.1.26", 8080)
    assert dp.probe().available  # the agent's start: turns accounting on in the node's namespace
    assert nsexec(topology.node, "sysctl", "-n", "net.netfilter.nf_conntrack_acct").stdout.strip() == "1"
    await dp.apply({WEB: web("10.244.1.26")})
    assert tcp_name(cli, VIP, 80) == "be-1"
    rows = [r for r in dp.flows_view() if r["service"] == WEB.key()]
    assert rows and rows[0]["datapath"] == "nftables" and rows[0]["endpoint"] == "10.244.1.26:8080"
    assert rows[0]["packets_in"] >= 3 and rows[0]["bytes_in"] > 0  # SYN, ACK, FIN at least
    assert rows[0]["packets_out"] >= 2 and rows[0]["bytes_out"] >= len("be-1")


async def test_c24_hairpin_is_masqueraded(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    be_a = pods.add("be-a", "10.244.1.70")
    hairpin_ports(topology)
    wait_listening(be_a, "10.244.1.70", 8080)
    await dp.apply({WEB: web("10.244.1.70")})
    with_peer = [tcp_peer_name(be_a, VIP, 80) for _ in range(20)]
    assert all(name == "be-a" and peer != "10.244.1.70" for name, peer in with_peer)


async def test_nodeport_from_outside_is_masqueraded_unless_local_policy(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    np = dict(node_port=30080, service_type="NodePort")
    await dp.apply({WEB: web("10.244.1.5", **np)})  # type: ignore[arg-type]
    assert tcp_peer_name(cli, "192.0.2.10", 30080)[1] != "10.244.9.10"
    assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"  # ClusterIP keeps the client address
    local = state(WEB, VIP, 80, [ep("10.244.1.5", node_name="node")], external_traffic_policy="Local", **np)
    await dp.apply({WEB: local})
    assert tcp_peer_name(cli, "192.0.2.10", 30080)[1] == "10.244.9.10"


async def test_refused_transaction_changes_nothing_and_resyncs(topology: Topology, dp: NftablesDatapath, pods: Pods) -> None:
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5"), spn("x"): state(spn("x"), "10.96.0.5", 80, [ep("10.244.3.5")])})
    nsexec(topology.node, "nft", "delete", "element", "ip", "usproxy", "slot-1", "{", VIP, ".", "tcp", ".", "80", "}")
    before = nft_list(topology.node)
    with pytest.raises(OffloadError) as err:
        await dp.apply({WEB: web("10.244.1.5", "10.244.3.5"), spn("x"): None})
    assert err.value.errno == 2
    assert nft_list(topology.node) == before  # spn x is still there: all or nothing
    await dp.apply({WEB: None})  # the model was read back, so removal succeeds
    assert VIP not in nft_list(topology.node)


async def test_a_refused_element_is_named_in_the_error(topology: Topology, dp: NftablesDatapath) -> None:
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5")})
    # an element put there behind our back, with other data than the one usproxy will add
    nsexec(topology.node, "nft", "add", "element", "ip", "usproxy", "service-ips",
           "{", "10.96.0.6", ".", "tcp", ".", "80", ":", "goto", "g-2", "}")
    with pytest.raises(OffloadError) as err:
        await dp.apply({spn("y"): state(spn("y"), "10.96.0.6", 80, [ep("10.244.3.5")])})
    assert err.value.errno == 17
    assert "File exists" in str(err.value) and "service-ips" in str(err.value) and "10.96.0.6" in str(err.value)


async def test_read_back_after_restart_changes_no_element(topology: Topology, dp: NftablesDatapath) -> None:
    sticky = state(spn("sticky"), "10.96.0.7", 80, [ep("10.244.1.5"), ep("10.244.2.5")],
                   session_affinity="ClientIP", affinity_timeout=30)
    states = {WEB: web("10.244.1.5", "10.244.2.5", node_port=30080, service_type="NodePort",
                       external_ips=["192.0.2.50"]),
              sticky.service_port.name: sticky, spn("empty"): state(spn("empty"), "10.96.0.8", 80, [])}
    await dp.apply(states)
    again = NftablesDatapath(netns=topology.node)
    try:
        found = await again.read_back()
        assert found == {n: tuple(sorted({*s.cluster_endpoints, *s.external_endpoints})) for n, s in states.items()}
        tx = [Transaction(again.tables[f]) for f in (4, 6)]
        for t in tx:
            for n, s in states.items():
                t.update(t.state.rules.get(n), port_rules(s, t.family, t.state.rules.get(n)))
        assert [c for t in tx for c in t.commands() if c.obj == "element"] == []
        await again.apply(states)
    finally:
        again.close()


async def test_cleanup_removes_both_tables(topology: Topology, dp: NftablesDatapath) -> None:
    await dp.apply({WEB: web("10.244.1.5")})
    assert "table ip usproxy" in nft_list(topology.node)
    await dp.cleanup()
    assert "usproxy" not in nft_list(topology.node)
    await dp.cleanup()  # absent tables are fine


def test_conntrack_tool_available(topology: Topology) -> None:
    assert conntrack(topology.node) == ""
