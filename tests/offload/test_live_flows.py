"""Live flows across the relay -> nftables handover: long-lived TCP connections and UDP sessions
that keep talking while their ServicePort is offloaded, on a fresh node (no usproxy table before
the first offload) and on a warm one (the table already serves another Service).

What must hold (README, "Kernel offload": live flows at each transition): a connection the relay owns is never
translated by the kernel datapath, whatever the order of events, so every TCP talker keeps its
connection and every echo comes back intact; a UDP session relayed before the offload keeps its
endpoint after it. New connections after the offload take the kernel path.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import Topology, nsexec
from tests.offload.agent import datapath_of, wait_for
from tests.offload.harness import Pods, tcp_peer_name
from tests.offload.live_flows import VIP, TcpTalker, UdpSession, services, start_pods
from tests.relay.harness import AgentProc, Manifests

pytestmark = pytest.mark.netns


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("node", ["fresh", "warm"])
def test_relayed_flows_survive_the_offload(topology: Topology, tmp_path: Path, pods: Pods, loop: str,
                                           node: str) -> None:
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = AgentProc(topology, m, loop, "--offload", "nftables", "--offload-after", "3",
                      "--min-sync-period", "200ms")
    try:
        if node == "warm":  # the table exists and serves `other` before web and dns are known
            m.write(*services(other=True)[4:])
            agent.start()
            wait_for(lambda: datapath_of(agent, "default/other:http") == "nftables", 15, "other offloaded")
            m.write(*services(other=True))
            wait_for(lambda: datapath_of(agent, "default/web:http") == "userspace", 5, "web relayed")
        else:
            m.write(*services())
            agent.start()
        assert datapath_of(agent, "default/web:http") == "userspace"
        talkers = [TcpTalker(cli) for _ in range(16)]
        sessions = [UdpSession(cli) for _ in range(6)]
        for t in (*talkers, *sessions):
            t.start()
        wait_for(lambda: datapath_of(agent, "default/web:http") == "nftables"
                 and datapath_of(agent, "default/dns:dns") == "nftables", 15, "offload")
        t_off = time.monotonic()
        time.sleep(3)  # every talker makes about 12 more round trips over the kernel-era table
        # new connections now take the kernel path: the endpoint sees the client's own address
        assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"
        for stop in [*(t.stop for t in talkers), *(s.stop for s in sessions)]:
            stop.set()
        for t in (*talkers, *sessions):
            t.join(5)
        assert [t.errors for t in talkers if t.errors] == []
        assert all(t.round_trips >= 12 for t in talkers), [t.round_trips for t in talkers]
        for s in sessions:
            assert len(s.endpoints()) == 1, f"UDP session moved between endpoints: {s.answers}"
            assert len([a for a in s.answers if a[0] > t_off]) >= 20
        # the relay still owns the relayed flows until they close: they are listed as its flows
    finally:
        agent.stop()


def test_a_relayed_connection_picked_up_mid_stream_is_not_translated(topology: Topology, tmp_path: Path,
                                                                      pods: Pods) -> None:
    """The relay's connections lose their conntrack entries after the offload (as when an entry
    expires under a long-idle connection, or `conntrack -F`): with nf_conntrack_tcp_loose the next
    segment starts a new entry mid-stream, and only a SYN may be DNATed, so the relay keeps them."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    m.write(*services()[:2])
    agent = AgentProc(topology, m, "uvloop", "--offload", "nftables", "--offload-after", "4",
                      "--min-sync-period", "200ms")
    try:
        agent.start()
        talkers = [TcpTalker(cli, period=0.1) for _ in range(4)]
        # the premise: all four connected through the relay (on a loaded CI machine one once
        # connected after the offload: a kernel flow whose entry is deleted is lost, as expected)
        assert datapath_of(agent, "default/web:http") == "userspace", "talkers connected after the offload"
        for t in talkers:
            t.start()
        wait_for(lambda: datapath_of(agent, "default/web:http") == "nftables", 15, "offload")
        assert nsexec(topology.node, "sysctl", "-n", "net.netfilter.nf_conntrack_tcp_loose").stdout.strip() == "1"
        nsexec(topology.node, "conntrack", "-D", "-p", "tcp", "--orig-dst", VIP, check=False)
        time.sleep(2)
        # the talkers' entries, re-created mid-stream by whichever segment came first: the client's
        # (original direction to the VIP) or, on a loaded machine, the relay's echo or ACK (original
        # direction from the VIP)
        picked_up = "".join(nsexec(topology.node, "conntrack", "-L", "-p", "tcp", way, VIP, check=False).stdout
                            for way in ("--orig-dst", "--orig-src"))
        assert picked_up.count("ESTABLISHED") >= 4, picked_up
        for t in talkers:
            t.stop.set()
        for t in talkers:
            t.join(5)
        assert [t.errors for t in talkers if t.errors] == []
        assert all(t.round_trips >= 30 for t in talkers), [t.round_trips for t in talkers]
    finally:
        agent.stop()
