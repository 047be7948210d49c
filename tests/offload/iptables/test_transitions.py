"""Live flows across the iptables datapath's transitions, through real agents: relay -> iptables
(the first offload), iptables -> nftables when the agent restarts with another --offload (the
iptables rules removed at start as leftovers), an agent restart on iptables, a demotion back to
the relay, and `usproxy run --cleanup`. Long-lived TCP talkers (a line every 250 ms, echoed) and
UDP sessions (a query every 100 ms on one connected socket) keep talking across each, on a fresh
node and on a warm one (iptables already serving another Service), with iptables-nft and (a
kubelet hint chain planted first, as on a node whose kubelet uses it) iptables-legacy; --cleanup
as the nftables datapath's (tests/offload/test_transitions.py): flows run on only where another
program's rule keeps the kernel tracking connections.

What must hold (README, "Kernel offload"): a connection the relay owns is never translated by the
rules (the first read back installs the skeleton, so conntrack tracks it from its first packet);
a kernel flow keeps its conntrack entry, and with it its NAT, when its rules change, go, or the
agent that wrote them stops; new connections take the datapath that holds the ServicePort now.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec
from tests.offload.harness import Pods, tcp_peer_name, wait_listening
from tests.offload.agent import datapath_of, wait_for
from tests.offload.live_flows import VIP, annotated, counts, finish, kept, one_endpoint, services, start_pods, talk
from tests.relay.harness import USPROXY, AgentProc, Manifests

pytestmark = pytest.mark.netns

WEB, DNS, OTHER = "default/web:http", "default/dns:dns", "default/other:http"
CLIENT = "10.244.9.10"


def flags(datapath: str, after: str = "1") -> tuple[str, ...]:
    return ("--offload", datapath, "--offload-after", after, "--min-sync-period", "100ms")


def on(agent: AgentProc, datapath: str, *names: str) -> bool:
    return all(datapath_of(agent, n) == datapath for n in names)


def use_backend(topology: Topology, backend: str) -> None:
    """Make the node's iptables `backend` as kubelet would: its hint chain in that backend's mangle."""
    if backend == "legacy":
        nsexec(topology.node, "iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")


def kube_chains(topology: Topology, backend: str) -> str:
    return "".join(line + "\n" for line in nsexec(topology.node, f"iptables-{backend}-save").stdout.splitlines()
                   if line.startswith(":KUBE-") and "HINT" not in line and "CANARY" not in line)


def start(topology: Topology, m: Manifests, node: str, datapath: str = "iptables", after: str = "1",
          loop: str = "uvloop") -> AgentProc:
    """An agent on web and dns; on a warm node `other` was offloaded before they were known."""
    agent = AgentProc(topology, m, loop, *flags(datapath, after))
    if node == "warm":
        m.write(*services(other=True)[4:])
        agent.start()
        wait_for(lambda: on(agent, datapath, OTHER), 15, "other offloaded")
        m.write(*services(other=True))
    else:
        m.write(*services())
        agent.start()
    return agent


@pytest.mark.parametrize(("node", "backend", "loop"), [("fresh", "nft", "uvloop"), ("warm", "nft", "asyncio"),
                                                       ("fresh", "legacy", "asyncio"), ("warm", "legacy", "uvloop")])
def test_relayed_flows_survive_the_offload_to_iptables(topology: Topology, tmp_path: Path, pods: Pods, node: str,
                                                       backend: str, loop: str) -> None:
    cli = start_pods(topology, pods)
    use_backend(topology, backend)
    m = Manifests(tmp_path / "m")
    agent = start(topology, m, node, after="3", loop=loop)
    try:
        wait_for(lambda: on(agent, "userspace", WEB, DNS), 5, "web and dns relayed")
        wait_listening(cli, VIP, 80)  # once, at load 11, a first connection met ENETUNREACH here
        r_tcp, r_udp = talk(cli, 12, 4)
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 15, "offload to iptables")
        t_off, before = time.monotonic(), counts(r_tcp)
        time.sleep(2.5)
        assert tcp_peer_name(cli, VIP, 80)[1] == CLIENT  # new connections: DNATed by the rules
        assert "KUBE-SERVICES" in kube_chains(topology, backend)
        finish(r_tcp, r_udp)
        kept(r_tcp, before, 8)
        one_endpoint(r_udp, t_off, 15)
    finally:
        agent.stop()


@pytest.mark.parametrize("node", ["fresh", "warm"])
def test_a_long_lived_connection_survives_relay_then_iptables_then_nftables(topology: Topology, tmp_path: Path,
                                                                            pods: Pods, node: str) -> None:
    """Talkers connected through the relay, then more through iptables; the agent restarts with
    --offload nftables, which removes the iptables rules at start (leftovers of a datapath it
    does not use, as kube-proxy's platformCleanup) and offloads to nftables: every talker and
    session runs on, and new connections are nftables'."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start(topology, m, node, after="3")
    try:
        wait_for(lambda: on(agent, "userspace", WEB, DNS), 5, "web and dns relayed")
        wait_listening(cli, VIP, 80)  # once, at load 11, a first connection met ENETUNREACH here
        r_tcp, r_udp = talk(cli, 6, 2)
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 15, "offload to iptables")
        k_tcp, k_udp = talk(cli, 6, 2)
        time.sleep(0.5)
        agent.stop()
        agent = AgentProc(topology, m, "uvloop", *flags("nftables"))
        agent.start()
        wait_for(lambda: on(agent, "nftables", WEB, DNS), 15, "offload to nftables")
        t_nft, before = time.monotonic(), counts(k_tcp)
        assert kube_chains(topology, "nft") == ""  # the iptables rules were removed at start
        assert "removed iptables" in agent.log.read_text()
        time.sleep(2)
        assert tcp_peer_name(cli, VIP, 80)[1] == CLIENT
        nft = [f for f in agent.flows() if f["datapath"] == "nftables"]
        finish(k_tcp + r_tcp, k_udp + r_udp)
        kept(k_tcp, before, 6)  # the kernel's flows, through both agents
        # the relay's own connections ended with the first agent's process (they were its sockets)
        assert all(t.errors for t in r_tcp), [t.errors for t in r_tcp]
        one_endpoint(k_udp, t_nft, 10)
        assert nft, "new flows are nftables'"
    finally:
        agent.stop()


@pytest.mark.parametrize(("node", "sig"), [("fresh", signal.SIGTERM), ("warm", signal.SIGKILL)])
def test_an_agent_restart_on_iptables_keeps_kernel_flows(topology: Topology, tmp_path: Path, pods: Pods, node: str,
                                                         sig: signal.Signals) -> None:
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start(topology, m, node)
    try:
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 15, "offload to iptables")
        k_tcp, k_udp = talk(cli, 6, 3)
        time.sleep(0.5)
        held = kube_chains(topology, "nft")
        t_down, before = time.monotonic(), counts(k_tcp)
        agent.stop(sig)
        time.sleep(1)
        kept(k_tcp, before, 3)  # while no agent runs
        agent.start()
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 10, "read back")
        assert f"read back {3 if node == 'warm' else 2} ServicePorts from iptables" in agent.log.read_text()
        assert kube_chains(topology, "nft") == held  # adopted, not rebuilt under other names
        before = counts(k_tcp)
        time.sleep(1)
        finish(k_tcp, k_udp)
        kept(k_tcp, before, 3)
        one_endpoint(k_udp, t_down, 15)
    finally:
        agent.stop()


def test_a_demotion_keeps_kernel_flows_and_new_ones_go_to_the_relay(topology: Topology, tmp_path: Path,
                                                                    pods: Pods) -> None:
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start(topology, m, "fresh")
    try:
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 15, "offload to iptables")
        k_tcp, k_udp = talk(cli, 6, 3)
        time.sleep(0.5)
        m.write(*annotated(services(), "userspace"))
        wait_for(lambda: on(agent, "userspace", WEB, DNS), 10, "demotion")
        t_dem, before = time.monotonic(), counts(k_tcp)
        time.sleep(1.5)
        assert tcp_peer_name(cli, VIP, 80)[1] != CLIENT  # the relay re-originates new connections
        listed: list[Any] = [f for f in agent.flows() if f["datapath"] == "iptables"]
        finish(k_tcp, k_udp)
        kept(k_tcp, before, 5)
        one_endpoint(k_udp, t_dem, 10)
        assert len([f for f in listed if f["protocol"] == "TCP"]) == 6, listed  # still listed, as kernel flows
    finally:
        agent.stop()


@pytest.mark.parametrize("node", ["usproxy-alone", "docker-masquerade"])
def test_cleanup_with_kernel_flows_open(topology: Topology, tmp_path: Path, pods: Pods, node: str) -> None:
    """`usproxy run --cleanup` (agent stopped) removes the rules. A network namespace tracks
    connections only while a rule there uses conntrack (iptables-nft's empty nat base chains,
    which stay, do not), so when the datapath's rules were the only ones the flows' next segments
    go to the ClusterIP untranslated and are reset; with another program's rule using conntrack
    (Docker's MASQUERADE) every flow runs on, on its endpoint, and that rule is still there."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start(topology, m, "fresh")
    docker = ("-s", "172.17.0.0/16", "!", "-o", "docker0", "-j", "MASQUERADE")
    if node == "docker-masquerade":
        nsexec(topology.node, "iptables-nft", "-t", "nat", "-A", "POSTROUTING", *docker)
    try:
        wait_for(lambda: on(agent, "iptables", WEB, DNS), 15, "offload to iptables")
        k_tcp, k_udp = talk(cli, 4, 2)
        time.sleep(0.5)
        agent.stop()
        res = nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        assert res.returncode == 0, res.stderr
        assert kube_chains(topology, "nft") == "" and kube_chains(topology, "legacy") == ""
        t_clean, before = time.monotonic(), counts(k_tcp)
        time.sleep(1.5)
        finish(k_tcp, k_udp)
        if node == "docker-masquerade":
            kept(k_tcp, before, 4)
            one_endpoint(k_udp, t_clean, 10)
            assert nsexec(topology.node, "iptables-nft", "-t", "nat", "-C", "POSTROUTING", *docker,
                          check=False).returncode == 0
        else:
            assert all(t.errors and t.round_trips <= before[i] + 2 for i, t in enumerate(k_tcp)), \
                (before, [t.errors for t in k_tcp])
    finally:
        agent.stop()
