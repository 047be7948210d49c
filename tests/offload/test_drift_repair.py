"""Kernel state changed behind the agent's back is repaired at the next full sync.

Fault class: drift between what the agent believes it installed and what the kernel holds (an
operator deletes the usproxy table, another tool removes elements). Full syncs (every 10 × sync
period; 0.5 s here, so every 5 s) read the table back and re-apply the difference, so an
offloaded Service that lost its kernel elements is served by the kernel again, and the relay
serves it meanwhile (its listener stays)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import Topology, nsexec
from tests.offload.agent import placement, wait_for, web
from tests.offload.harness import OFFLOAD, Pods, nft_list, tcp_name, wait_listening
from tests.relay.harness import AgentProc, Manifests

pytestmark = pytest.mark.netns


def test_deleted_table_is_rebuilt_at_the_next_full_sync(topology: Topology, tmp_path: Path, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"]))
    agent = AgentProc(topology, m, "uvloop", *OFFLOAD, "--sync-period", "500ms")
    try:
        agent.start()
        wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
        assert "10.96.10.10 . tcp . 80" in nft_list(topology.node)
        nsexec(topology.node, "nft", "delete", "table", "ip", "usproxy")
        assert tcp_name(cli, "10.96.10.10", 80) == "be-a"  # the relay's listener serves meanwhile
        deadline = time.monotonic() + 15
        while "10.96.10.10 . tcp . 80" not in nft_list(topology.node):
            assert time.monotonic() < deadline, "table not rebuilt"
            time.sleep(0.2)
        assert placement(agent)[0] == "nftables"
        assert tcp_name(cli, "10.96.10.10", 80) == "be-a"
    finally:
        assert agent.stop() == 0


def test_flushed_hooked_chain_is_rewritten_at_the_next_full_sync(topology: Topology, tmp_path: Path, pods: Pods) -> None:
    """The table and its elements intact, but `ct state invalid drop` (field case C25) flushed
    away: a diff of ServicePorts alone would never notice; the full sync rewrites the chain."""
    pods.add("be-a", "10.244.1.6")
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.6"]))
    agent = AgentProc(topology, m, "uvloop", *OFFLOAD, "--sync-period", "500ms")
    try:
        agent.start()
        wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
        assert "ct state invalid drop" in ip_table(topology.node)
        nsexec(topology.node, "nft", "flush", "chain", "ip", "usproxy", "filter-forward")
        assert "ct state invalid drop" not in ip_table(topology.node)
        deadline = time.monotonic() + 15
        while "ct state invalid drop" not in ip_table(topology.node):
            assert time.monotonic() < deadline, "filter-forward not rewritten"
            time.sleep(0.2)
        assert placement(agent)[0] == "nftables"
    finally:
        assert agent.stop() == 0


def ip_table(ns: str) -> str:
    """The `ip usproxy` table alone (the ip6 one has its own `ct state invalid drop`)."""
    return nsexec(ns, "nft", "list", "table", "ip", "usproxy").stdout
