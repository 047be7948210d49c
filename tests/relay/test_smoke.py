"""Smoke: TCP through a ClusterIP and a NodePort reaches real backends, round robin, flows shown."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import wait_until

pytestmark = pytest.mark.netns


def ask(ns: str, addr: str, port: int) -> str:
    with inside(ns):
        with socket.create_connection((addr, port), timeout=3) as s:
            name = s.makefile().readline().strip()
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
            return name


def test_clusterip_and_nodeport_round_robin(topology: Topology, backends: Backends, workdir: Path,
                                            loop_name: str) -> None:
    for i in (1, 2):
        ns = topology.add_host(f"be{i}", f"10.244.{i}.5")
        backends.start(ns, "idsrv", f"be{i}", f"10.244.{i}.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(svc("web", "10.96.10.10", [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
                type="NodePort"),
            slice_("web", [{"ip": "10.244.1.5", "ready": True}, {"ip": "10.244.2.5", "ready": True}],
                   [{"name": "http", "port": 8080, "protocol": "TCP"}]))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        names = Counter(ask(cli, "10.96.10.10", 80) for _ in range(10))
        assert names == {"be1": 5, "be2": 5}
        names = Counter(ask(cli, "192.0.2.10", 30080) for _ in range(10))
        assert names == {"be1": 5, "be2": 5}
        with inside(cli):
            held = socket.create_connection(("10.96.10.10", 80), timeout=3)
        with held:
            held.makefile().readline()
            # The short connections above end asynchronously: wait until their flows leave the
            # table (a loaded run still listed the last NodePort flow when it read /flows).
            def only_held() -> bool:
                return [f["original"]["dst"] for f in agent.flows()] == ["10.96.10.10:80"]
            assert wait_until(only_held, 5.0), agent.flows()
            assert agent.flows()[0]["original"]["src"].startswith("10.244.9.10:")
    finally:
        assert agent.stop() == 0
