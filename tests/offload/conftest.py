"""Fixtures shared by the offload tests: pods (idsrv in pod namespaces of `topology`), IPv6 and
IPv4 responders for pods (ipv6_topology.py) and real agents with nftables offload, each stopped
at the end of its test whatever happens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.offload.harness import OFFLOAD, Pods
from tests.offload.ipv6_topology import Responders
from tests.relay.harness import AgentProc, Manifests


@pytest.fixture
def pods(topology: Topology, tmp_path: Path) -> Iterator[Pods]:
    p = Pods(topology, tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def servers(topology: Topology) -> Iterator[Responders]:
    r = Responders()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def agent_factory(topology: Topology) -> Iterator[Callable[[Manifests], AgentProc]]:
    """Builds agents (uvloop, nftables offload after 1 s) on `manifests`; stops them at the end."""
    agents: list[AgentProc] = []

    def make(manifests: Manifests) -> AgentProc:
        a = AgentProc(topology, manifests, "uvloop", *OFFLOAD)
        agents.append(a)
        return a

    try:
        yield make
    finally:
        for a in agents:
            a.stop()
