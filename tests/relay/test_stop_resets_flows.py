"""A relay that stops resets the connections it carries: a cut stream must not look complete.

Fault class: end-of-stream honesty at exit. The relay's TCP connections end with its process
(README, Restart). Left to the kernel's close at exit, a download whose client had not read
everything yet ended with FIN after the bytes already buffered: a client that reads to EOF (HTTP/1.0,
a file to EOF) took the cut stream for the whole one. On SIGTERM the relay now resets both legs
(SO_LINGER 0), so the client's read fails with ECONNRESET, for a flow moved to splice (a fast bulk
download) and one held back by its reader (a download the client stopped reading).
"""

from __future__ import annotations

import signal
import socket
import struct
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.case_c11 import BE, BLOB, VIP, objects
from tests.relay.harness import AgentProc, Backends, Manifests
from tests.relay.tcp_clients import start_server
from tests.relay.tcp_servers import MIB

pytestmark = pytest.mark.netns

LENGTH = 64 * 1024 * MIB  # far more than either client reads before the stop


def read_at_least(s: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        chunk = s.recv(MIB)
        assert chunk, f"EOF after {got} bytes"
        got += len(chunk)
    return got


def read_to_end(s: socket.socket) -> str:
    """'reset' if the stream ends with ECONNRESET, 'eof after N bytes' if it ends cleanly."""
    got = 0
    try:
        while chunk := s.recv(MIB):
            got += len(chunk)
    except ConnectionResetError:
        return "reset"
    return f"eof after {got} bytes"


def test_sigterm_resets_relayed_connections(topology: Topology, backends: Backends, workdir: Path,
                                            loop_name: str) -> None:
    be = topology.add_host("bea", BE)
    start_server(backends, be, "blob", BE, str(BLOB))
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    conns: list[socket.socket] = []
    try:
        agent.start()
        with inside(cli):
            fast, stalled = (socket.create_connection((VIP, BLOB), timeout=10) for _ in range(2))
        conns += [fast, stalled]
        for s in conns:
            s.sendall(struct.pack("!Q", LENGTH))
        read_at_least(fast, 64 * MIB)  # a bulk flow: moved to splice
        read_at_least(stalled, 64 * 1024)  # then never read again: the relay holds its bytes back
        time.sleep(0.3)
        assert agent.stop(signal.SIGTERM) == 0
        assert [read_to_end(s) for s in conns] == ["reset", "reset"]
    finally:
        for s in conns:
            s.close()
        agent.stop()

