"""A node daemon owns a Service port (issue 18 item 4), on the real agent in a node netns.

Before: a daemon listening on 0.0.0.0:2222 silently received the traffic of a Service on
10.96.6.6:2222 (ClusterIPs are local addresses and the relay's specific bind fails under a
wildcard listener, see usproxy/relay/port_holder.py), a Service on the agent's own health port
was answered by the health server, and "listen failed" was logged once per retry. Now /services
names the cause and the holder, the line is logged once, and the relay takes the port as soon
as the holder lets it go.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, wait_until
from tests.relay.udp_helpers import client_socket
from usproxy.relay.port_holder import holding_sockets

pytestmark = pytest.mark.netns
THREAD_PROC = Path("/proc/thread-self")  # /proc/net follows the process, not a thread inside a netns
SSH = [{"name": "ssh", "port": 2222, "protocol": "TCP"}]
DNS = [{"name": "ssh", "port": 2222, "protocol": "UDP"}]


def services(cluster_ip: str, health_ip: str, dns_ip: str) -> list[dict[str, object]]:
    be = [{"ip": "10.244.1.5", "ready": True}]
    return [svc("sshlike", cluster_ip, [{"name": "ssh", "port": 2222, "targetPort": 2222}]),
            slice_("sshlike", be, SSH),
            svc("hc", health_ip, [{"name": "ssh", "port": 10256, "targetPort": 2222}]),
            slice_("hc", be, SSH),
            svc("dnslike", dns_ip, [{"name": "ssh", "port": 2223, "targetPort": 2222, "protocol": "UDP"}]),
            slice_("dnslike", be, DNS)]


def bound_udp(ns: str, port: int) -> bool:
    with inside(ns):
        return bool(holding_sockets("10.96.6.6", port, "UDP", THREAD_PROC))


def listening(ns: str, port: int) -> bool:
    with inside(ns):
        return attempt("127.0.0.1", port, timeout=1.0).kind == "ok"


def udp_answer(ns: str, dst: tuple[str, int], payload: bytes) -> bytes:
    """The answer to one datagram, from whatever source (a wildcard socket answers from the
    address routing picks, not from the ClusterIP)."""
    with client_socket(ns) as s:
        s.sendto(payload, dst)
        return s.recvfrom(65535)[0]


def reason(agent: AgentProc, name: str) -> str:
    rows = {r["servicePortName"]: r for r in agent.services()}
    return str(rows[f"default/{name}:ssh"]["reason"])


def test_node_daemon_owns_a_service_port(topology: Topology, backends: Backends, workdir: Path,
                                         loop_name: str) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "2222")
    cli = topology.add_host("cli", "10.244.9.10")
    daemon = backends.start(topology.node, "idsrv", "daemon", "0.0.0.0", "2222")
    udp_daemon = backends.start(topology.node, "idsrv", "daemon", "0.0.0.0", "2223", "--udp")
    assert wait_until(lambda: listening(topology.node, 2222), timeout=3.0)  # it says ready before bind
    assert wait_until(lambda: bound_udp(topology.node, 2223), timeout=3.0)
    m = Manifests(workdir)
    m.write(*services("10.96.6.6", "10.96.6.7", "10.96.6.8"))
    agent = AgentProc(topology, m, loop_name, "--healthz-bind-address", "0.0.0.0:10256")

    def who(addr: str, port: int) -> str:
        with inside(cli):
            out = attempt(addr, port, timeout=2.0)
        return out.name if out.kind == "ok" else out.kind

    try:
        agent.start()
        # The kernel hands the Service's connections to the daemon; /services says so and by whom.
        assert who("10.96.6.6", 2222) == "daemon"
        held = reason(agent, "sshlike")
        assert "listen 10.96.6.6:2222: Address already in use" in held, held
        assert f"held by 0.0.0.0:2222 of pid {daemon.pid} (" in held, held
        assert udp_answer(cli, ("10.96.6.8", 2223), b"q") == b"daemon|q"  # from the bridge's address
        udp = reason(agent, "dnslike")
        assert f"listen 10.96.6.8:2223: Address already in use (held by 0.0.0.0:2223 of pid {udp_daemon.pid} (" in udp, udp
        own = reason(agent, "hc")
        assert f"held by 0.0.0.0:10256 of this agent (pid {agent.pid()})" in own, own
        time.sleep(3.5)  # a few sweeps, each retrying the listeners
        text = agent.log.read_text()
        assert text.count("listen 10.96.6.6:2222: Address already in use") == 1, text
        assert text.count("listen 10.96.6.7:10256: Address already in use") == 1, text
        # The daemon leaves: the relay takes the port at its next retry and serves the Service.
        backends.stop(daemon)
        assert wait_until(lambda: who("10.96.6.6", 2222) == "be1", timeout=5.0)
        assert reason(agent, "sshlike") == "listening on 10.96.6.6:2222"
        assert "default/sshlike:ssh: listening on 10.96.6.6:2222/TCP after all" in agent.log.read_text()
    finally:
        assert agent.stop() == 0
