"""IptablesDatapath against the real kernel in a throwaway node namespace (no agent, no relay), with
both backends (iptables-nft and iptables-legacy): forwarded TCP and UDP to every endpoint, endpoint
changes, refusal without endpoints (C01), a NodePort masqueraded, the node's own connections
(nat OUTPUT), ClientIP affinity, a pod reaching itself through its Service (hairpin), UDP conntrack
clearing (C03, and an endpoint removed while the agent was down), a restart that adopts the rules
under a live connection (C20), and cleanup that leaves Docker's and a firewall's rules as they
were."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.core.stale_udp import StaleUdp
from usproxy.model.node import NodeFacts
from usproxy.offload.iptables.backend import Tools
from usproxy.offload.iptables.datapath import IptablesDatapath

from tests.netns import Topology, inside, nsexec
from tests.offload.harness import Pods, tcp_name, tcp_peer_name, udp_socket, wait_listening
from tests.offload.helpers import ep, spn, state

pytestmark = pytest.mark.netns

VIP = "10.96.10.10"
WEB = spn("web", "http")
NODE_IP = "192.0.2.10"


@pytest.fixture(params=["nft", "legacy"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dp(topology: Topology, backend: str) -> Iterator[IptablesDatapath]:
    # ClusterIPs routed but not local: what the rules neither DNAT nor refuse goes nowhere. Routed
    # back out of the bridge they came in on, so no ICMP redirect may use up the per-host ICMP
    # budget that REJECT's port unreachable needs (a redirect is sent before the FORWARD hook)
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/16", "dev", "usbr0")
    for key in ("net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.usbr0.send_redirects=0"):
        nsexec(topology.node, "sysctl", "-qw", key)
    d = IptablesDatapath(netns=topology.node, node=NodeFacts("node"), backend=backend)  # type: ignore[arg-type]
    assert d.probe().available, d.probe()
    try:
        yield d
    finally:
        d.close()


def web(*ips: str, port: int = 8080, **kw: object) -> ServicePortState:
    return state(WEB, VIP, 80, [ep(i, port) for i in ips], **kw)


def save(topology: Topology, backend: str) -> str:
    """iptables-save of the node without its comment lines and counters."""
    text = nsexec(topology.node, *Tools(backend).save(4)).stdout  # type: ignore[arg-type]
    return "\n".join(line.split(" [")[0] if line.startswith(":") else line
                     for line in text.splitlines() if not line.startswith("#"))


async def test_forwarded_tcp_and_udp_reach_every_endpoint(topology: Topology, dp: IptablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    wait_listening(cli, "10.244.2.5", 8080)
    dns = state(spn("dns", proto="UDP"), "10.96.10.11", 53, [ep("10.244.1.5"), ep("10.244.2.5")])
    await dp.read_back()
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5"), dns.service_port.name: dns})
    assert set(Counter(tcp_name(cli, VIP, 80) for _ in range(60))) == {"be-a", "be-b"}
    seen = set()
    for _ in range(40):
        s = udp_socket(cli)
        s.settimeout(2)
        s.sendto(b"q", ("10.96.10.11", 53))
        data, src = s.recvfrom(512)
        s.close()
        assert src == ("10.96.10.11", 53)  # the kernel reverses the NAT
        seen.add(data.split(b"|")[0])
    assert seen == {b"be-a", b"be-b"}
    assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"  # pod to ClusterIP: not masqueraded


async def test_endpoint_changes_refusal_and_nodeport(topology: Topology, dp: IptablesDatapath, pods: Pods) -> None:
    for i in (1, 2):
        pods.add(f"be-{i}", f"10.244.{i}.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.2.5", 8080)
    np = dict(node_port=30080, service_type="NodePort")
    await dp.apply({WEB: web(**np)})  # type: ignore[arg-type]
    for addr, port in ((VIP, 80), (NODE_IP, 30080)):
        with pytest.raises(ConnectionRefusedError):
            tcp_name(cli, addr, port)  # C01: REJECT, at once
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5", **np)})  # type: ignore[arg-type]
    assert {tcp_name(cli, VIP, 80) for _ in range(40)} == {"be-1", "be-2"}
    name, peer = tcp_peer_name(cli, NODE_IP, 30080)
    assert peer == "10.244.0.1"  # a NodePort with externalTrafficPolicy Cluster is masqueraded
    await dp.apply({WEB: web("10.244.2.5", **np)})  # type: ignore[arg-type]
    assert {tcp_name(cli, VIP, 80) for _ in range(20)} == {"be-2"}
    assert dp.full_syncs == 1 and dp.syncs == 3


async def test_the_nodes_own_connections_and_affinity(topology: Topology, dp: IptablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    wait_listening(topology.node, "10.244.2.5", 8080)
    sticky = web("10.244.1.5", "10.244.2.5", session_affinity="ClientIP", affinity_timeout=60)
    await dp.apply({WEB: sticky})
    names = {tcp_name(topology.node, VIP, 80) for _ in range(20)}  # nat OUTPUT
    assert len(names) == 1 and names <= {"be-a", "be-b"}


async def test_a_pod_reaches_itself_through_its_service(topology: Topology, dp: IptablesDatapath, pods: Pods) -> None:
    pod = pods.add("be-a", "10.244.1.5")
    wait_listening(pod, "10.244.1.5", 8080)
    await dp.apply({WEB: web("10.244.1.5")})
    name, peer = tcp_peer_name(pod, VIP, 80)
    assert name == "be-a" and peer == "10.244.0.1"  # KUBE-SEP's "-s ep -j KUBE-MARK-MASQ": hairpin masqueraded


async def test_c03_a_udp_sender_follows_endpoint_removal(topology: Topology, dp: IptablesDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.7", port=8125, mute=True)
    pods.add("be-b", "10.244.2.8", port=8125, mute=True)
    cli = topology.add_host("cli", "10.244.9.10")
    statsd = spn("statsd", proto="UDP")

    def st(*ips: str) -> ServicePortState:
        return state(statsd, "10.96.20.20", 8125, [ep(i, 8125) for i in ips])

    s = udp_socket(cli, ("10.244.9.10", 41000))
    s.connect(("10.96.20.20", 8125))
    await dp.apply({statsd: st("10.244.1.7")})
    for _ in range(10):
        s.send(b"m:1|c")
    time.sleep(0.3)
    a = pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0)
    assert a >= 9
    await dp.apply({statsd: st("10.244.2.8")})
    await dp.clear_stale({statsd: frozenset({ep("10.244.1.7", 8125)})})
    for _ in range(10):
        s.send(b"m:1|c")
    time.sleep(0.3)
    assert pods.counts("be-b", "udp", 8125).get("10.244.2.8", 0) >= 9
    assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) == a
    s.close()


async def test_an_endpoint_removed_while_the_agent_was_down_loses_its_udp_sessions(
        topology: Topology, dp: IptablesDatapath, pods: Pods, backend: str) -> None:
    """The next agent never sees the removal, so no sync names the endpoint: reconcile_udp (the
    offload manager's pass after a full sync, as kube-proxy's CleanStaleEntries) deletes every
    UDP entry of the frontend whose reply source is not a current endpoint, and the session's
    next datagram takes the new endpoint. Without it the session stays on the old one."""
    pods.add("be-a", "10.244.1.7", port=8125, mute=True)
    pods.add("be-b", "10.244.2.8", port=8125, mute=True)
    cli = topology.add_host("cli", "10.244.9.10")
    statsd = spn("statsd", proto="UDP")

    def st(*ips: str) -> ServicePortState:
        return state(statsd, "10.96.20.20", 8125, [ep(i, 8125) for i in ips])

    def burst() -> None:
        for _ in range(10):
            s.send(b"m:1|c")
        time.sleep(0.3)

    s = udp_socket(cli, ("10.244.9.10", 41000))
    s.connect(("10.96.20.20", 8125))
    await dp.read_back()
    await dp.apply({statsd: st("10.244.1.7")})
    burst()
    a = pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0)
    assert a >= 9
    dp.close()  # the agent stops; be-a goes while it is down
    nxt = IptablesDatapath(netns=topology.node, node=NodeFacts("node"), backend=backend)  # type: ignore[arg-type]
    try:
        await nxt.read_back()
        await nxt.apply({statsd: st("10.244.2.8")})
        burst()
        assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) >= a + 9  # its entry still DNATs to be-a
        await nxt.reconcile_udp(StaleUdp.of([st("10.244.2.8")]))
        burst()
        assert pods.counts("be-b", "udp", 8125).get("10.244.2.8", 0) >= 9
    finally:
        nxt.close()
        s.close()


async def test_c20_a_restart_adopts_the_rules_under_a_live_connection(topology: Topology, dp: IptablesDatapath,
                                                                      pods: Pods, backend: str) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    await dp.read_back()
    await dp.apply({WEB: web("10.244.1.5")})
    before = save(topology, backend)
    with inside(cli):
        conn = socket.create_connection((VIP, 80), timeout=3)
    assert conn.recv(64).startswith(b"be-a")
    dp.close()
    again = IptablesDatapath(netns=topology.node, node=NodeFacts("node"), backend=backend)  # type: ignore[arg-type]
    try:
        assert set(await again.read_back()) == {WEB}
        await again.apply({WEB: web("10.244.1.5")})
        conn.sendall(b"still there")
        assert conn.recv(64) == b"still there"
        assert save(topology, backend) == before
    finally:
        conn.close()
        again.close()


async def test_cleanup_leaves_docker_and_firewall_rules_as_they_were(topology: Topology, dp: IptablesDatapath,
                                                                      backend: str) -> None:
    tools = Tools(backend)  # type: ignore[arg-type]
    foreign = ("*filter\n:DOCKER - [0:0]\n:DOCKER-USER - [0:0]\n:ufw-user-input - [0:0]\n"
               "-A INPUT -j ufw-user-input\n-A ufw-user-input -p tcp --dport 22 -j ACCEPT\n"
               "-A FORWARD -j DOCKER-USER\n-A FORWARD -o docker0 -j DOCKER\n-A DOCKER-USER -j RETURN\nCOMMIT\n"
               "*nat\n:DOCKER - [0:0]\n-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER\n"
               "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE\nCOMMIT\n")
    nsexec(topology.node, "sh", "-c", f"printf '{foreign}' | {tools.command(4, 'restore')} --noflush")
    before = save(topology, backend)
    await dp.read_back()
    await dp.apply({WEB: web("10.244.1.5", node_port=30080, service_type="NodePort")})
    assert "KUBE-SERVICES" in save(topology, backend)
    await dp.cleanup()
    after = save(topology, backend)
    # what cleanup leaves: the foreign rules, and empty tables the datapath made exist (mangle)
    assert [line for line in after.splitlines() if line.startswith("-A")] == \
        [line for line in before.splitlines() if line.startswith("-A")]
    assert "KUBE-" not in after


async def test_a_local_clusterip_is_dropped_where_kube_proxy_drops(topology: Topology, dp: IptablesDatapath,
                                                                   pods: Pods) -> None:
    """usproxy's ClusterIPs are local addresses (usproxy0): a packet to one passes filter INPUT,
    where kube-proxy's rules have no jump, so usproxy adds one (jumps.LOCAL_CLUSTER_IPS):
    internalTrafficPolicy Local without a local endpoint drops, as kube-proxy, instead of the
    node refusing (no listener)."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    nsexec(topology.node, "ip", "link", "add", "uspt0", "type", "bridge")
    nsexec(topology.node, "ip", "addr", "add", f"{VIP}/32", "dev", "uspt0")
    nsexec(topology.node, "ip", "link", "set", "uspt0", "up")
    await dp.read_back()
    await dp.apply({WEB: web("10.244.1.5", internal_traffic_policy="Local")})  # be-a is on no node
    with pytest.raises(TimeoutError):
        tcp_name(cli, VIP, 80, timeout=1.5)
    await dp.apply({WEB: web()})
    with pytest.raises(ConnectionRefusedError):
        tcp_name(cli, VIP, 80)  # REJECT (the node would refuse too)


def test_the_probe_leaves_no_table_behind(topology: Topology) -> None:
    """`usproxy check` probes the node it runs on: the throwaway chain goes into a namespace of
    its own, so not even an empty nat or filter table is left (iptables-nft would create them)."""
    for backend in ("nft", "legacy", None):
        d = IptablesDatapath(netns=topology.node, backend=backend)
        try:
            assert d.probe().available
        finally:
            d.close()
    assert nsexec(topology.node, "nft", "list", "ruleset").stdout.strip() == ""
    assert nsexec(topology.node, "cat", "/proc/net/ip_tables_names").stdout.strip() == ""
    assert nsexec(topology.node, "sysctl", "-n", "net.netfilter.nf_conntrack_acct").stdout.strip() == "0"
