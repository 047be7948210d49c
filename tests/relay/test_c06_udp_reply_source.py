"""C06: every UDP reply comes from exactly the address and port the client sent to.

Fault class: reply source-address selection on wildcard, redirected or multi-address UDP
sockets. A relay that answers from a wildcard or redirected socket lets the kernel pick the
source (the node's primary address, or the socket's real port), and a client with a connected
socket then drops every reply silently; an unconnected resolver rejects it as spoofed. Two
Services (one with a NodePort, served on both node addresses) are queried through all four
frontends, 100 times from a connected socket and 100 times from one unconnected socket that
checks each reply's source with recvfrom; each answer must also name the right Service's
backend. No reductions: 800 queries, as the case says.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.udp_helpers import client_socket, start_udpsrv

pytestmark = pytest.mark.netns

FRONTENDS = {("10.96.0.10", 53): b"be-a", ("10.96.0.11", 53): b"be-b",
             ("192.0.2.10", 30053): b"be-a", ("192.0.2.11", 30053): b"be-a"}
N = 100


def manifests(m: Manifests) -> None:
    udp53 = [{"port": 53, "protocol": "UDP"}]
    m.write(svc("dns-a", "10.96.0.10", [{"port": 53, "targetPort": 53, "protocol": "UDP", "nodePort": 30053}],
                type="NodePort"),
            svc("dns-b", "10.96.0.11", [{"port": 53, "targetPort": 53, "protocol": "UDP"}]),
            slice_("dns-a", [{"ip": "10.244.1.5", "ready": True}], udp53),
            slice_("dns-b", [{"ip": "10.244.2.6", "ready": True}], udp53))


def connected_round(cli: str, dst: tuple[str, int], want: bytes) -> int:
    """N queries on one connected socket: the kernel drops any reply from another source."""
    ok = 0
    with client_socket(cli, connect=dst) as s:
        for i in range(N):
            q = b"c%d" % i
            s.send(q)
            if s.recv(65535) == want + b"|" + q:
                ok += 1
    return ok


def unconnected_round(s: socket.socket, dst: tuple[str, int], want: bytes) -> int:
    ok = 0
    for i in range(N):
        q = b"u%d" % i
        s.sendto(q, dst)
        data, src = s.recvfrom(65535)
        assert src == dst, f"reply to {dst} came from {src}"
        if data == want + b"|" + q:
            ok += 1
    return ok


def test_replies_come_from_the_frontend(topology: Topology, backends: Backends, workdir: Path,
                                        loop_name: str) -> None:
    for name, ip in (("be-a", "10.244.1.5"), ("be-b", "10.244.2.6")):
        start_udpsrv(backends, topology.add_host(name, ip), name, ip, 53)
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    manifests(m)
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        answered = 0
        with client_socket(cli) as loose:
            for dst, want in FRONTENDS.items():
                answered += connected_round(cli, dst, want)
                answered += unconnected_round(loose, dst, want)
        assert answered == 8 * N
    finally:
        assert agent.stop() == 0
