"""C05: UDP datagrams of every size pass the relay whole, one for one, both ways.

Fault class: buffer sizing and datagram-boundary preservation. A relay that reads into a buffer
smaller than the datagram truncates it silently (recv drops the tail unless MSG_TRUNC is
checked); one that treats UDP as a byte stream merges or splits datagrams. Every size from 0 to
the IPv4 maximum (65,507) is sent 3 times through a ClusterIP to a pure echo server, and each echo
must match in length and sha256 and arrive as exactly one untruncated datagram. (The IPv6 maximum,
65,527, is C23's.) No reductions: 42 datagrams, as the case says.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.relay.case_c05 import SIZES, recv_whole
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.udp_helpers import client_socket

pytestmark = pytest.mark.netns


def test_every_size_echoed_whole(topology: Topology, backends: Backends, workdir: Path,
                                 loop_name: str) -> None:
    be = topology.add_host("be-a", "10.244.1.9")
    backends.start(be, "echo", "10.244.1.9", "7", "--udp")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(svc("echo-udp", "10.96.30.30", [{"port": 7, "targetPort": 7, "protocol": "UDP"}]),
            slice_("echo-udp", [{"ip": "10.244.1.9", "ready": True}], [{"port": 7, "protocol": "UDP"}]))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        s = client_socket(cli, connect=("10.96.30.30", 7))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        good = 0
        with s:
            for size in SIZES:
                for _ in range(3):
                    sent = os.urandom(size)
                    s.send(sent)
                    echo = recv_whole(s)
                    assert (len(echo), hashlib.sha256(echo).digest()) == (size, hashlib.sha256(sent).digest())
                    good += 1
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):  # nothing split off or duplicated is left over
                s.recv(65535)
        assert good == 42
        flows = agent.flows()
        assert [(f["packets_in"], f["packets_out"]) for f in flows] == [(42, 42)]
        assert flows[0]["bytes_in"] == flows[0]["bytes_out"] == 3 * sum(SIZES)
    finally:
        assert agent.stop() == 0


def test_bursts_of_equal_datagrams_pass_one_for_one(topology: Topology, backends: Backends, workdir: Path,
                                                    loop_name: str) -> None:
    """Datagrams read back to back for one flow leave the relay in one UDP_SEGMENT send each way
    (udp_batch.py); they must still arrive as the same datagrams, whole and in order, and be
    counted one by one in the flow. 30 bursts of 20 × 1,400 B, each answered before the next."""
    be = topology.add_host("be-a", "10.244.1.9")
    backends.start(be, "echo", "10.244.1.9", "7", "--udp")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(svc("echo-udp", "10.96.30.30", [{"port": 7, "targetPort": 7, "protocol": "UDP"}]),
            slice_("echo-udp", [{"ip": "10.244.1.9", "ready": True}], [{"port": 7, "protocol": "UDP"}]))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        s = client_socket(cli, connect=("10.96.30.30", 7))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.settimeout(5)
        with s:
            for burst in range(30):
                sent = [burst.to_bytes(2, "big") + i.to_bytes(2, "big") + os.urandom(1396) for i in range(20)]
                for d in sent:
                    s.send(d)
                assert [recv_whole(s) for _ in sent] == sent
        flows = agent.flows()
        assert [(f["packets_in"], f["packets_out"]) for f in flows] == [(600, 600)]
        assert flows[0]["bytes_in"] == flows[0]["bytes_out"] == 600 * 1400
    finally:
        assert agent.stop() == 0
