"""C09: TCP half-close is relayed in each direction, and teardown leaks nothing.

Fault class: TCP teardown. A FIN from either side becomes shutdown(SHUT_WR) on the other leg and
nothing more (the other direction keeps flowing, for seconds if need be); once both directions
have seen EOF the proxy closes both legs by itself (without waiting for the client to close), and
a reset on one leg is passed on as a reset, never as a clean EOF. No descriptor or socket state
(CLOSE_WAIT, FIN_WAIT2, LAST_ACK) is left behind.

Numbers as in the case: 1 MiB each way, D = 5 s, the server-first client sends its 1 MiB over 2 s,
200 connections per variant; both legs closed (agent fd count at baseline ± 4, no flows) within 1 s
of the last EOF while the clients still hold their sockets open, and no CLOSE_WAIT, FIN_WAIT2 or
LAST_ACK in the node netns after 2 s. Reduction: the two client-first variants run at the same time
(400 connections in flight), then the server-first one (200 at once), not one after another.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
import time
from pathlib import Path

import pytest

from tests.netns import Topology, nsexec
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import fd_count, run_async, start_server, wait_until
from tests.relay.tcp_servers import MIB, pattern_chunks, pattern_digest

pytestmark = pytest.mark.netns

VIP = "10.96.50.50"
BE = "10.244.1.13"
N = 200
PORTS = {"first": 9000, "delayed": 9001, "server-first": 9002, "abort": 9003, "upload": 9004}
BAD_STATES = ("CLOSE-WAIT", "FIN-WAIT-2", "LAST-ACK")


def objects() -> list[dict[str, object]]:
    ports = [{"name": n, "port": p, "targetPort": p} for n, p in PORTS.items()]
    return [svc("half", VIP, ports),
            slice_("half", [{"ip": BE, "ready": True}], [{"name": n, "port": p, "protocol": "TCP"}
                                                          for n, p in PORTS.items()])]


async def send_mib(w: asyncio.StreamWriter, pace: float = 0.0) -> None:
    for part in pattern_chunks(MIB, chunk=64 * 1024):
        w.write(part)
        await w.drain()
        if pace:
            await asyncio.sleep(pace)


async def read_to_eof(r: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """(count, first 32 bytes, sha256 of the rest) of everything until EOF."""
    head = bytearray()
    h, n = hashlib.sha256(), 0
    while chunk := await r.read(256 * 1024):
        n += len(chunk)
        if len(head) < 32:
            take = 32 - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        h.update(chunk)
    return n, bytes(head), h.digest()


async def client_first(port: int) -> asyncio.StreamWriter:
    """Send 1 MiB, FIN, read sha256 + 1 MiB and EOF; returns the still open writer."""
    r, w = await asyncio.open_connection(VIP, port)
    await send_mib(w)
    w.write_eof()
    n, head, rest = await read_to_eof(r)
    assert (n, head, rest) == (32 + MIB, pattern_digest(MIB), pattern_digest(MIB))
    return w


async def server_first(port: int) -> None:
    """Read 1 MiB and the FIN, then send 1 MiB over 2 s, then close."""
    r, w = await asyncio.open_connection(VIP, port)
    n, _, _ = await read_to_eof(r)
    assert n == MIB
    await send_mib(w, pace=2.0 / 16)
    w.close()
    await w.wait_closed()


def test_half_close_both_directions(topology: Topology, backends: Backends, workdir: Path,
                                    loop_name: str) -> None:
    be = topology.add_host("bea", BE)
    log = workdir / "server-first.log"
    start_server(backends, be, "eofsrv", BE, str(PORTS["first"]), "--order", "client-first")
    start_server(backends, be, "eofsrv", BE, str(PORTS["delayed"]), "--order", "client-first", "--delay", "5")
    start_server(backends, be, "eofsrv", BE, str(PORTS["server-first"]), "--order", "server-first",
                 "--log", str(log))
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        baseline = fd_count(agent.pid())

        async def run() -> None:
            started = time.monotonic()
            writers = await asyncio.gather(*(client_first(PORTS["first"]) for _ in range(N)),
                                           *(client_first(PORTS["delayed"]) for _ in range(N)))
            await asyncio.gather(*(server_first(PORTS["server-first"]) for _ in range(N)))
            assert time.monotonic() - started >= 5.0  # the delayed replies did wait 5 s
            # Both directions saw EOF; the clients still hold their sockets: the proxy must close.
            closed = await asyncio.to_thread(
                wait_until, lambda: fd_count(agent.pid()) <= baseline + 4 and not agent.flows(), 1.0)
            for w in writers:
                w.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
            assert closed, f"fds {fd_count(agent.pid())} (baseline {baseline}), flows {len(agent.flows())}"

        run_async(cli, run)
        lines = wait_until(lambda: len(log.read_text().splitlines()) >= N, 2.0) and log.read_text().splitlines()
        assert lines and [int(line.split()[1]) for line in lines] == [MIB] * N
        assert wait_until(lambda: not bad_sockets(topology.node), 2.0), bad_sockets(topology.node)
    finally:
        assert agent.stop() == 0


def bad_sockets(node_ns: str) -> list[str]:
    out = nsexec(node_ns, "ss", "-tanH").stdout.splitlines()
    return [line for line in out if line.split()[0] in BAD_STATES]


def test_reset_is_relayed_as_reset(topology: Topology, backends: Backends, workdir: Path,
                                   loop_name: str) -> None:
    """An endpoint's RST reaches the client as ECONNRESET, and a client's RST reaches the endpoint."""
    be = topology.add_host("bea", BE)
    log = workdir / "upload.log"
    start_server(backends, be, "abortsrv", BE, str(PORTS["abort"]), "--after", str(64 * 1024))
    start_server(backends, be, "upload", BE, str(PORTS["upload"]), "--log", str(log))
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        baseline = fd_count(agent.pid())

        async def endpoint_aborts() -> str:
            try:
                r, w = await asyncio.open_connection(VIP, PORTS["abort"])
            except ConnectionResetError:  # the endpoint's 64 KiB and RST came before connect() returned
                return "reset"
            try:
                while await r.read(65536):
                    pass
                return "clean EOF"
            except ConnectionResetError:
                return "reset"
            finally:
                w.close()

        async def client_aborts() -> None:
            r, w = await asyncio.open_connection(VIP, PORTS["upload"])
            w.write(b"x" * 4096)
            await w.drain()
            await asyncio.sleep(0.05)
            w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()  # RST

        async def run() -> list[str]:
            got = await asyncio.gather(*(endpoint_aborts() for _ in range(20)))
            await asyncio.gather(*(client_aborts() for _ in range(20)))
            return got

        assert run_async(cli, run) == ["reset"] * 20
        assert wait_until(lambda: len(log.read_text().splitlines()) >= 20 if log.exists() else False, 2.0)
        assert sorted({line.split()[1] for line in log.read_text().splitlines()}) == ["reset"]
        assert wait_until(lambda: fd_count(agent.pid()) <= baseline + 4 and not agent.flows(), 1.0)
    finally:
        assert agent.stop() == 0
