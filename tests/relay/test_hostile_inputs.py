"""Operator mistakes and floods the relay must survive (found by trying to break it).

Fault class: resource exhaustion and self-inflicted loops. An endpoint that is the proxy's own
NodePort must not make every connection dial itself until descriptors run out; a flood of UDP
flows from fresh source ports must not lock TCP out of a full flow table; a Service whose
ClusterIP is a node address must not break that address's NodePorts across a restart; a listener
address taken by another process is taken over soon after it is freed, not at the next periodic
sync. Each test runs the real agent in a node netns, on uvloop (the loop-independent parts are
covered on both loops by the field-case tests).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import USPROXY, AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import ask_in, attempt, wait_until

pytestmark = pytest.mark.netns
HTTP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def fds(agent: AgentProc) -> int:
    return len(os.listdir(f"/proc/{agent.pid()}/fd"))


def web(*endpoints: str, cluster_ip: str = "10.96.10.10") -> list[dict[str, object]]:
    return [svc("web", cluster_ip, [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
                type="NodePort"),
            slice_("web", [{"ip": ip, "ready": True} for ip in endpoints], HTTP)]


def test_endpoint_that_is_our_own_nodeport_is_refused_not_looped(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    loop = [svc("loop", "10.96.10.20", [{"name": "http", "port": 80, "targetPort": 30080}]),
            slice_("loop", [{"ip": "192.0.2.11", "ready": True}], [{"name": "http", "port": 30080}])]
    m.write(*web("10.244.1.5"), *loop)
    agent = AgentProc(topology, m)
    try:
        agent.start()
        base = fds(agent)
        with inside(cli):
            outcomes = [attempt("10.96.10.20", 80).kind for _ in range(5)]
        assert set(outcomes) <= {"reset", "empty"}, outcomes  # refused by the relay, quickly
        assert fds(agent) < base + 20
        assert ask_in(cli, "10.96.10.10", 80) == "be1"  # everything else keeps working
        assert "own frontend" in agent.log.read_text()
    finally:
        assert agent.stop() == 0


def test_udp_flood_does_not_lock_tcp_out_of_a_full_flow_table(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "53", "--udp")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    dns = [svc("dns", "10.96.0.10", [{"name": "dns", "port": 53, "protocol": "UDP"}]),
           slice_("dns", [{"ip": "10.244.1.5", "ready": True}], [{"name": "dns", "port": 53, "protocol": "UDP"}])]
    m.write(*web("10.244.1.5"), *dns)
    agent = AgentProc(topology, m, "uvloop", "--conntrack-min", "50", "--conntrack-max-per-core", "0")
    try:
        agent.start()
        with inside(cli):
            socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(80)]
        for s in socks:
            s.sendto(b"x", ("10.96.0.10", 53))
        time.sleep(0.5)
        answered = [ask_in(cli, "10.96.10.10", 80) for _ in range(5)]
        assert answered == ["be1"] * 5
        assert len(agent.flows()) <= 50
        for s in socks:
            s.close()
    finally:
        assert agent.stop() == 0


def test_cluster_ip_equal_to_a_node_address_leaves_nodeports_working_after_restart(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    odd = [svc("odd", "192.0.2.10", [{"name": "http", "port": 81, "targetPort": 8080}]),
           slice_("odd", [{"ip": "10.244.1.5", "ready": True}], HTTP)]
    m.write(*web("10.244.1.5"), *odd)
    agent = AgentProc(topology, m)
    try:
        for _ in range(2):  # before and after a restart
            agent.start()
            assert ask_in(cli, "192.0.2.10", 30080) == "be1"
            assert ask_in(cli, "192.0.2.10", 81) == "be1"
            agent.stop()
    finally:
        agent.stop()


def test_listener_taken_by_another_process_is_taken_over_when_freed(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*web("10.244.1.5"))
    with inside(topology.node):
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("192.0.2.10", 30080))
        squatter.listen()
    agent = AgentProc(topology, m)
    try:
        agent.start()
        assert ask_in(cli, "10.96.10.10", 80) == "be1"  # the ClusterIP is unaffected
        squatter.close()
        assert wait_until(lambda: attempt_in(cli, "192.0.2.10", 30080) == "ok", timeout=3.0)
    finally:
        squatter.close()
        assert agent.stop() == 0


def attempt_in(ns: str, addr: str, port: int) -> str:
    with inside(ns):
        return attempt(addr, port, timeout=1.0).kind


def test_connection_flood_beyond_the_descriptor_limit_is_refused_and_the_agent_lives(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*web("10.244.1.5"))
    agent = AgentProc(topology, m)
    agent.wrapper = ("prlimit", "--nofile=256:256")
    held: list[socket.socket] = []
    try:
        agent.start()
        with inside(cli):
            for _ in range(300):
                try:
                    s = socket.create_connection(("10.96.10.10", 80), timeout=3)
                except ConnectionResetError:  # refused (reset) before connect() returned: a refusal too
                    continue
                held.append(s)
        time.sleep(0.5)
        assert fds(agent) < 256
        for s in held:
            s.close()
        held.clear()
        assert wait_until(lambda: attempt_in(cli, "10.96.10.10", 80) == "ok", timeout=5.0)
        t_upd = m.write(*web("10.244.1.5", cluster_ip="10.96.10.11"))  # manifests still read
        agent.wait_synced_after(t_upd)
        assert wait_until(lambda: attempt_in(cli, "10.96.10.11", 80) == "ok", timeout=3.0)
        assert "Too many open files" not in agent.log.read_text()
    finally:
        for s in held:
            s.close()
        assert agent.stop() == 0


def test_a_second_agent_in_the_same_network_namespace_refuses_to_start(
        topology: Topology, workdir: Path) -> None:
    m = Manifests(workdir)
    m.write(*web())
    first = AgentProc(topology, m)
    try:
        first.start()
        second = subprocess.run(
            ["ip", "netns", "exec", topology.node, USPROXY, "run", "--services", str(workdir),
             "--healthz-bind-address", "127.0.0.1:11256", "--metrics-bind-address", "127.0.0.1:11249"],
            capture_output=True, text=True, timeout=30)
        assert second.returncode == 1
        assert f"another usproxy agent (pid {first.pid()}) runs in this network namespace" in second.stderr
        assert first.services()  # the first one is untouched
    finally:
        assert first.stop() == 0
