"""C22 (TCP part): TCP and UDP on the same port number are different services.

Fault class: the protocol must be part of every service, flow and NodePort key. A TCP frontend
must only ever reach the TCP target port, a TCP listener must not appear where only a UDP service
exists, and removing the TCP port of a Service must leave its UDP port (same number, same
NodePort) untouched.

Numbers as in the case for TCP: 100 connections to 10.96.0.10:53 and 100 to 192.0.2.10:30053, all
answered by the TCP target port (5354); echo-tcp echoes; after the TCP port is removed, TCP to
:53 and :30053 is refused within 1 s. Traps make a crossing visible instead of merely refused:
be-a also serves TCP on the UDP target port 5353, and be-y (echo-udp) also serves TCP on 7. The
UDP side is checked lightly (20 queries per frontend before and after the removal, all answered by
udp/5353); the full UDP numbers belong to the UDP tests.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.case_c22 import BE_A, BE_X, BE_Y, DNS, ECHO_TCP, ECHO_UDP, NODE, objects, tcp_echo
from tests.relay.harness import AgentProc, Backends, Manifests
from tests.relay.tcp_clients import attempt, wait_until

pytestmark = pytest.mark.netns


def udp_ask(addr: str, port: int) -> bytes:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.settimeout(2.0)
        s.connect((addr, port))
        s.send(b"q")
        return s.recv(2048)
    finally:
        s.close()


def test_tcp_and_udp_on_one_port(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    be_a = topology.add_host("bea", BE_A)
    backends.start(be_a, "idsrv", "tcp:be-a", BE_A, "5354")
    backends.start(be_a, "idsrv", "udp:be-a", BE_A, "5353", "--udp")
    backends.start(be_a, "idsrv", "wrong:tcp-on-udp-target", BE_A, "5353")
    backends.start(topology.add_host("bex", BE_X), "echo", BE_X, "7")
    be_y = topology.add_host("bey", BE_Y)
    backends.start(be_y, "echo", BE_Y, "7", "--udp")
    backends.start(be_y, "idsrv", "wrong:tcp-to-echo-udp", BE_Y, "7")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        with inside(cli):
            for front in ((DNS, 53), (NODE, 30053)):
                got = [attempt(*front) for _ in range(100)]
                assert {(o.kind, o.name) for o in got} == {("ok", "tcp:be-a")}, front
                assert {udp_ask(*front) for _ in range(20)} == {b"udp:be-a|q"}, front
            assert tcp_echo(ECHO_TCP, 7) == b"hello"
            assert attempt(ECHO_UDP, 7).kind == "refused"  # no TCP service there
            assert udp_ask(ECHO_UDP, 7) == b"q"

            t_upd = m.write(*objects(with_tcp=False))
            for front in ((DNS, 53), (NODE, 30053)):
                assert wait_until(lambda: attempt(*front).kind == "refused", t_upd + 1.0 - time.monotonic(), 0.0)
            time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
            for front in ((DNS, 53), (NODE, 30053)):
                assert {attempt(*front).kind for _ in range(20)} == {"refused"}, front
                assert {udp_ask(*front) for _ in range(20)} == {b"udp:be-a|q"}, front
            assert tcp_echo(ECHO_TCP, 7) == b"hello"
    finally:
        assert agent.stop() == 0
