"""A node daemon on a wildcard address does not take Service traffic (issue 29 item 6; before it,
issue 18 item 4), on the real agent in a node netns.

Before: a daemon listening on 0.0.0.0:2222 received the connections of a Service on
10.96.6.6:2222 (ClusterIPs are local addresses and the relay's specific bind fails under a
wildcard listener, see usproxy/relay/port_holder.py), a Service on the agent's own health port
was answered by the health server, a UDP Service's datagrams went to a UDP daemon, and under
offload every new Service went to the daemon for its first ~5 s; /services only named the
holder. kube-proxy, even 1.0's userspace mode, redirected in netfilter before the socket lookup.

Now such a frontend is captured (usproxy/relay/port_capture.py): a DNAT ahead of the socket
lookup to a listener of the relay's on the same address. Checked for each mechanism
(`--relay-capture nftables` and `iptables`, the way for kernels without nf_tables) on both
loops: the Service's TCP, UDP and health-port frontends reach the endpoint, the UDP reply comes
from the Service's own address and port (C06), /services names the holder and the capture,
/flows keeps the original destination; a long-lived connection keeps talking when the daemon
goes away; with no endpoint the frontend is refused, not handed to the daemon; a Service added
while a client keeps connecting is captured from its first connection, also under offload.
`--relay-capture none` keeps the old report (the daemon gets the traffic).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.harness import OFFLOAD
from tests.relay.harness import USPROXY, AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, wait_until
from tests.relay.udp_helpers import client_socket
from usproxy.relay.port_holder import holding_sockets

pytestmark = pytest.mark.netns
THREAD_PROC = Path("/proc/thread-self")  # /proc/net follows the process, not a thread inside a netns
SSH = [{"name": "ssh", "port": 2222, "protocol": "TCP"}]
DNS = [{"name": "ssh", "port": 2222, "protocol": "UDP"}]
BE = [{"ip": "10.244.1.5", "ready": True}]


def services(endpoints: list[dict[str, Any]] = BE, late: bool = False) -> list[dict[str, Any]]:
    out = [svc("sshlike", "10.96.6.6", [{"name": "ssh", "port": 2222, "targetPort": 2222}]),
           slice_("sshlike", endpoints, SSH),
           svc("hc", "10.96.6.7", [{"name": "ssh", "port": 10256, "targetPort": 2222}]),
           slice_("hc", BE, SSH),
           svc("dnslike", "10.96.6.8", [{"name": "ssh", "port": 2223, "targetPort": 2222, "protocol": "UDP"}]),
           slice_("dnslike", BE, DNS)]
    if late:
        out += [svc("late", "10.96.6.9", [{"name": "ssh", "port": 2222, "targetPort": 2222}]), slice_("late", BE, SSH)]
    return out


def bound_udp(ns: str, port: int) -> bool:
    with inside(ns):
        return bool(holding_sockets("10.96.6.6", port, "UDP", THREAD_PROC))


def listening(ns: str, port: int) -> bool:
    with inside(ns):
        return attempt("127.0.0.1", port, timeout=1.0).kind == "ok"


def udp_exchange(ns: str, dst: tuple[str, int], payload: bytes) -> tuple[bytes, tuple[str, int]]:
    """The answer to one datagram and where it came from (an unconnected socket sees any source)."""
    with client_socket(ns) as s:
        s.sendto(payload, dst)
        data, src = s.recvfrom(65535)
        return data, (src[0], src[1])


def reason(agent: AgentProc, name: str) -> str:
    rows = {r["servicePortName"]: r for r in agent.services()}
    return str(rows[f"default/{name}:ssh"]["reason"])


class Daemons:
    """The node's own daemons on 0.0.0.0: TCP 2222 and UDP 2223 (both answer "daemon")."""

    def __init__(self, topology: Topology, backends: Backends) -> None:
        self.tcp = backends.start(topology.node, "idsrv", "daemon", "0.0.0.0", "2222")
        self.udp = backends.start(topology.node, "idsrv", "daemon", "0.0.0.0", "2223", "--udp")
        assert wait_until(lambda: listening(topology.node, 2222), timeout=3.0)  # it says ready before bind
        assert wait_until(lambda: bound_udp(topology.node, 2223), timeout=3.0)


def setup(topology: Topology, backends: Backends) -> tuple[str, Daemons]:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "2222")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "2222", "--udp")
    return topology.add_host("cli", "10.244.9.10"), Daemons(topology, backends)


def who(cli: str, addr: str, port: int) -> str:
    with inside(cli):
        out = attempt(addr, port, timeout=2.0)
    return out.name if out.kind == "ok" else out.kind


@pytest.mark.parametrize("mechanism", ["nftables", "iptables"])
def test_a_held_port_is_captured_for_the_relay(topology: Topology, backends: Backends, workdir: Path,
                                               loop_name: str, mechanism: str) -> None:
    cli, daemons = setup(topology, backends)
    m = Manifests(workdir)
    m.write(*services())
    agent = AgentProc(topology, m, loop_name, "--healthz-bind-address", "0.0.0.0:10256",
                      "--relay-capture", mechanism)
    try:
        agent.start()
        assert who(cli, "10.96.6.6", 2222) == "be1"  # was "daemon"
        assert who(cli, "10.96.6.7", 10256) == "be1"  # was the agent's own health server
        assert udp_exchange(cli, ("10.96.6.8", 2223), b"q") == (b"be1|q", ("10.96.6.8", 2223))  # was "daemon|q"
        held = reason(agent, "sshlike")
        assert held.startswith("listening on 10.96.6.6:2222 (held by 0.0.0.0:2222 of pid "), held
        assert held.endswith(f"; captured by {mechanism})"), held
        assert f"held by 0.0.0.0:10256 of this agent (pid {agent.pid()}); captured by {mechanism}" in reason(agent, "hc")
        with inside(topology.node):  # the node's own connection is captured too (nat output hook)
            assert attempt("10.96.6.6", 2222).name == "be1"
        # A long-lived connection through the capture keeps talking while the daemon goes away.
        with inside(cli):
            conn = socket.create_connection(("10.96.6.6", 2222), timeout=3)
        stream = conn.makefile("rwb")
        assert stream.readline() == b"be1\n"
        dst = [f["original"]["dst"] for f in agent.flows() if f["protocol"] == "TCP"]
        assert "10.96.6.6:2222" in dst, dst  # the relay knows the original destination
        backends.stop(daemons.tcp)
        for i in range(5):
            stream.write(b"line %d\n" % i)
            stream.flush()
            assert stream.readline() == b"line %d\n" % i
            time.sleep(0.2)
        conn.close()
        # No endpoint: refused at once, as kube-proxy; with the daemon back, never handed to it.
        backends.start(topology.node, "idsrv", "daemon", "0.0.0.0", "2222")
        assert wait_until(lambda: listening(topology.node, 2222), timeout=3.0)
        agent.wait_synced_after(m.write(*services(endpoints=[])))
        assert who(cli, "10.96.6.6", 2222) == "refused"
        agent.wait_synced_after(m.write(*services()))
        assert wait_until(lambda: who(cli, "10.96.6.6", 2222) == "be1", timeout=3.0)
        # While no agent runs, the capture stays and refuses (the relay's port is closed): the
        # daemon does not get the Service during a restart. --cleanup removes it.
        assert agent.stop() == 0
        assert who(cli, "10.96.6.6", 2222) == "refused"
        nsexec(topology.node, USPROXY, "run", "--cleanup", "--vip-interface", "usproxy0")
        assert "usproxy-capture" not in nsexec(topology.node, "nft", "list", "ruleset").stdout
        assert "USPROXY-CAPTURE" not in nsexec(topology.node, "iptables-save").stdout
        assert who(cli, "10.96.6.6", 2222) != "be1"
    finally:
        agent.stop()


@pytest.mark.parametrize("offload", [False, True], ids=["relay", "nftables-offload"])
def test_a_new_service_is_captured_from_its_first_connection(topology: Topology, backends: Backends,
                                                            workdir: Path, loop_name: str, offload: bool) -> None:
    """A client connects every 20 ms to a ClusterIP before its Service exists; once the Service is
    written, no attempt may reach the daemon (under offload, the relay serves the first
    --offload-after seconds, which used to be the daemon's)."""
    if offload and loop_name != "uvloop":
        pytest.skip("the kernel serves what this case checks after the window; one loop suffices")
    cli, _ = setup(topology, backends)
    m = Manifests(workdir)
    m.write(*services())
    extra = (*OFFLOAD[:2], "--offload-after", "5") if offload else ()
    agent = AgentProc(topology, m, loop_name, *extra)
    seen: list[str] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            with inside(cli):
                out = attempt("10.96.6.9", 2222, timeout=0.5)
            seen.append(out.name if out.kind == "ok" else out.kind)
            time.sleep(0.02)

    t = threading.Thread(target=hammer)
    try:
        agent.start()
        t.start()
        time.sleep(0.3)
        agent.wait_synced_after(m.write(*services(late=True)))
        assert wait_until(lambda: "be1" in seen, timeout=5.0), seen[-20:]
        stop.set()
        t.join()
        assert "daemon" not in seen, seen
        if offload:  # a connection the relay took through the capture runs on after the offload
            with inside(cli):
                conn = socket.create_connection(("10.96.6.9", 2222), timeout=3)
            stream = conn.makefile("rwb")
            assert stream.readline() == b"be1\n"

            def placed() -> bool:
                return reason(agent, "late").startswith("established")

            for i in range(100):
                stream.write(b"line %d\n" % i)
                stream.flush()
                assert stream.readline() == b"line %d\n" % i
                if placed() and i > 5:
                    break
                time.sleep(0.1)
            assert placed(), reason(agent, "late")
            for i in range(3):
                stream.write(b"after %d\n" % i)
                stream.flush()
                assert stream.readline() == b"after %d\n" % i
            conn.close()
            assert who(cli, "10.96.6.9", 2222) == "be1"  # new connections: the kernel's DNAT
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        assert agent.stop() == 0


def test_without_capture_the_holder_is_named(topology: Topology, backends: Backends, workdir: Path) -> None:
    """`--relay-capture none`: the old behaviour, reported (issue 18 item 4): the daemon gets the
    traffic, /services names it, the line is logged once, and the relay takes the port as soon
    as the holder lets it go."""
    cli, daemons = setup(topology, backends)
    m = Manifests(workdir)
    m.write(*services())
    agent = AgentProc(topology, m, "uvloop", "--relay-capture", "none")
    try:
        agent.start()
        assert who(cli, "10.96.6.6", 2222) == "daemon"
        held = reason(agent, "sshlike")
        assert f"listen 10.96.6.6:2222: Address already in use (held by 0.0.0.0:2222 of pid {daemons.tcp.pid} (" in held
        time.sleep(2.5)  # a few sweeps, each retrying the listeners
        assert agent.log.read_text().count("listen 10.96.6.6:2222: Address already in use") == 1
        backends.stop(daemons.tcp)
        assert wait_until(lambda: who(cli, "10.96.6.6", 2222) == "be1", timeout=5.0)
        assert reason(agent, "sshlike") == "listening on 10.96.6.6:2222"
    finally:
        assert agent.stop() == 0
