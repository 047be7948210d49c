"""Spliced bulk flows (usproxy/relay/tcp_splice.py), on loopback through a real ClientSide, on both
event loops: the hand-over from the transports loses no byte and keeps every semantic of the
event-loop path.

Fault classes: bytes lost or reordered at the hand-over (checksums each way), half-close in each
direction after the flow went bulk (FIN after the last byte, the other way still open), a reset
passed on as a reset, unbounded buffering (a client that never reads: the relay holds at most one
pipe beyond the kernel's socket queues), flow accounting (bytes per direction in the flow), the idle
timeout's closer, descriptors (pipes counted, given back once; refused pipes keep the flow on the
event loop) and small messages, which must never leave the event loop's path.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

from usproxy.flows.flow_table import Flow, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.relay import tcp_splice
from usproxy.relay import tcp
from usproxy.relay.tcp import ClientSide
from usproxy.model.types import Scope, ServicePortName

MIB = 1 << 20
SIOCINQ, SIOCOUTQ = 0x541B, 0x5411  # FIONREAD, TIOCOUTQ (Linux)
T = TypeVar("T")


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def patient_dials(monkeypatch: pytest.MonkeyPatch) -> None:
    """One dial of 10 s: a loaded machine must not time the loopback dial out (the tests'
    endpoints accept one connection)."""
    monkeypatch.setattr(tcp, "DIAL_TIMEOUTS", (10.0,))


def run(loop_name: str, coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro) if loop_name == "uvloop" else asyncio.run(coro)


class Owner:
    """A FlowOwner with one endpoint on loopback; it records flows, sides and pipe counts."""

    spn = ServicePortName("default", "bulk", "tcp", "TCP")

    def __init__(self, port: int, pipes: bool = True) -> None:
        self.ep = Endpoint(ipaddress.ip_address("127.0.0.1"), port)
        self.pipes = pipes
        self.pipes_held = 0
        self.flows: list[Flow] = []
        self.ended: list[Flow] = []
        self.sides: list[ClientSide] = []

    def pick(self, kind: Scope, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        return None if self.ep in exclude else self.ep

    def failed(self, kind: Scope, ep: Endpoint) -> None:
        pass

    def opened(self, kind: Scope, ep: Endpoint) -> None:
        pass

    def closed(self, kind: Scope, ep: Endpoint) -> None:
        pass

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        self.flows.append(Flow(protocol, self.spn, client, frontend))
        return self.flows[-1]

    def end_flow(self, flow: Flow) -> None:
        self.ended.append(flow)

    def reserve_pipes(self) -> bool:
        if self.pipes:
            self.pipes_held += 1
        return self.pipes

    def release_pipes(self) -> None:
        self.pipes_held -= 1

    def side(self) -> ClientSide:
        s = ClientSide(self, "cluster", ("127.0.0.1", 0))
        self.sides.append(s)
        return s


Backend = Callable[[socket.socket], None]


async def relayed(backend: Backend, client: Callable[[socket.socket, Owner], T], pipes: bool = True) -> tuple[T, Owner]:
    """Run `backend` (per accepted connection, in a thread) behind a relay on loopback and
    `client` (in a thread) against the relay; return what `client` returned and the owner."""
    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: _serve_one(lsock, backend), daemon=True).start()
    owner = Owner(lsock.getsockname()[1], pipes)
    server = await asyncio.get_running_loop().create_server(owner.side, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def connect() -> T:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
            return client(c, owner)

    try:
        result = await asyncio.to_thread(connect)
        await until(lambda: len(owner.ended) == 1)
        return result, owner
    finally:
        server.close()
        lsock.close()


def _serve_one(lsock: socket.socket, backend: Backend) -> None:
    conn, _ = lsock.accept()
    conn.settimeout(20)
    with conn:
        backend(conn)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def pattern(n: int, seed: int) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "big")).digest(n)


def send_all(s: socket.socket, data: bytes) -> None:
    s.sendall(data)


def read_to_eof(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 18):
        out += chunk
    return bytes(out)


def sender_thread(s: socket.socket, data: bytes, fin: bool) -> threading.Thread:
    def go() -> None:
        s.sendall(data)
        if fin:
            s.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def spliced(owner: Owner) -> bool:
    return bool(owner.sides) and owner.sides[0].spliced is not None


UP, DOWN = pattern(24 * MIB, 1), pattern(24 * MIB, 2)


def test_bulk_each_way_is_spliced_intact_and_counted(loop_name: str) -> None:
    def backend(conn: socket.socket) -> None:
        t = sender_thread(conn, DOWN, fin=True)
        assert read_to_eof(conn) == UP
        t.join()

    def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
        t = sender_thread(c, UP, fin=True)
        got = read_to_eof(c)
        t.join()
        return got, spliced(owner)

    (got, was_spliced), owner = run(loop_name, relayed(backend, client))
    assert was_spliced
    assert got == DOWN
    flow = owner.flows[0]
    assert (flow.bytes_in, flow.bytes_out) == (len(UP), len(DOWN))
    assert flow.state == "CLOSING" and owner.pipes_held == 0


@pytest.mark.parametrize("first", ["client", "endpoint"])
def test_half_close_after_going_bulk_each_direction(loop_name: str, first: str) -> None:
    """One side sends its bulk and FIN; the other reads it all to EOF, then answers in bulk
    over the half-closed connection and closes."""
    def talk(s: socket.socket, sent: bytes, answer: bytes) -> bytes:
        s.sendall(sent)
        s.shutdown(socket.SHUT_WR)
        return read_to_eof(s)

    def answer(s: socket.socket, expect: bytes, reply: bytes) -> None:
        assert read_to_eof(s) == expect  # EOF only after the last byte
        s.sendall(reply)

    if first == "client":
        def backend(conn: socket.socket) -> None:
            answer(conn, UP, DOWN)

        def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
            return talk(c, UP, DOWN), spliced(owner)
        want = DOWN
    else:
        def backend(conn: socket.socket) -> None:
            assert talk(conn, DOWN, UP) == UP

        def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
            answer(c, DOWN, UP)
            return b"", spliced(owner)
        want = b""
    (got, was_spliced), owner = run(loop_name, relayed(backend, client))
    assert was_spliced and got == want
    assert (owner.flows[0].bytes_in, owner.flows[0].bytes_out) == (len(UP), len(DOWN))


def test_reset_after_going_bulk_is_passed_on_as_reset(loop_name: str) -> None:
    def backend(conn: socket.socket) -> None:
        conn.sendall(DOWN[:8 * MIB])
        time.sleep(0.5)  # the client has read it all: the flow is spliced by now
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
        got = bytearray()
        try:
            while len(got) < 8 * MIB and (chunk := c.recv(1 << 18)):
                got += chunk
            was = spliced(owner)
            c.recv(1)
        except ConnectionResetError:
            return bytes(got), was
        raise AssertionError("no reset")

    (got, was_spliced), owner = run(loop_name, relayed(backend, client))
    assert was_spliced and got == DOWN[:8 * MIB]


def test_a_client_that_never_reads_costs_at_most_one_pipe(loop_name: str) -> None:
    """The endpoint writes far more than every buffer holds; the client reads 4 MiB, then stops.
    Once the endpoint's writes stall, what the relay read from it and the client's kernel queues
    (its receive queue, the relay leg's send queue) do not hold is at most one pipe."""
    total = 96 * MIB
    stalled = threading.Event()

    def backend(conn: socket.socket) -> None:
        conn.settimeout(2)  # per send: 2 s without progress is a stall
        data, sent = memoryview(pattern(total, 3)), 0
        try:
            while sent < total:
                sent += conn.send(data[sent:sent + MIB])
        except TimeoutError:
            stalled.set()

    async def check(owner: Owner, c: socket.socket, got: int) -> None:
        await asyncio.to_thread(stalled.wait, 30)
        assert stalled.is_set() and spliced(owner)
        relay_leg = owner.sides[0].spliced
        assert relay_leg is not None
        queued = _ioctl(c, SIOCINQ) + _ioctl(relay_leg.client, SIOCOUTQ)
        held = owner.flows[0].bytes_out - got - queued
        assert 0 <= held <= tcp_splice.PIPE_SIZE
        relay_leg.expire()  # end it (the idle timeout's closer)

    async def main() -> None:
        lsock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=lambda: _serve_one(lsock, backend), daemon=True).start()
        owner = Owner(lsock.getsockname()[1])
        server = await asyncio.get_running_loop().create_server(owner.side, "127.0.0.1", 0)
        c = socket.create_connection(("127.0.0.1", server.sockets[0].getsockname()[1]))
        try:
            got = await asyncio.to_thread(_read_n, c, 4 * MIB)
            await check(owner, c, got)
            await until(lambda: len(owner.ended) == 1)
            assert owner.pipes_held == 0
        finally:
            c.close()
            server.close()
            lsock.close()

    run(loop_name, main())


def test_idle_timeout_closer_resets_a_spliced_flow(loop_name: str) -> None:
    def backend(conn: socket.socket) -> None:
        conn.sendall(DOWN[:8 * MIB])
        try:
            conn.recv(1)
        except OSError:
            pass

    async def main() -> None:
        lsock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=lambda: _serve_one(lsock, backend), daemon=True).start()
        owner = Owner(lsock.getsockname()[1])
        server = await asyncio.get_running_loop().create_server(owner.side, "127.0.0.1", 0)
        c = socket.create_connection(("127.0.0.1", server.sockets[0].getsockname()[1]), timeout=20)
        try:
            assert await asyncio.to_thread(_read_n, c, 8 * MIB) == 8 * MIB
            await until(lambda: spliced(owner))
            flow = owner.flows[0]
            assert flow.closer is not None and flow.liveness is not None
            assert flow.liveness() is not None  # TCP_INFO of the spliced sockets
            flow.closer()
            with pytest.raises(ConnectionResetError):
                await asyncio.to_thread(c.recv, 1)
            await until(lambda: len(owner.ended) == 1)
            assert owner.pipes_held == 0
        finally:
            c.close()
            server.close()
            lsock.close()

    run(loop_name, main())


def test_a_client_that_reads_only_after_writing_everything_is_not_stalled(loop_name: str) -> None:
    """The endpoint sends its bulk at once; the client first uploads its own and reads only then.
    The reply fills the client leg's buffer (no pipes while it does: the reply's own streak would
    splice the flow at once), which cannot empty while the client writes, so the upload's
    hand-over (which pauses both directions until both buffers are empty) is given up after
    HANDOVER_WAIT and the upload goes on: no deadlock, every byte each way, and the reply's
    direction still stops reading at the client leg's high-water mark."""
    def backend(conn: socket.socket) -> None:
        t = sender_thread(conn, DOWN, fin=True)
        assert read_to_eof(conn) == UP
        t.join()

    def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
        time.sleep(0.5)  # the reply stalls on the client leg first
        owner.pipes = True
        c.sendall(UP)
        c.shutdown(socket.SHUT_WR)
        leg = owner.sides[0].transport  # backpressure held after the hand-over was given up:
        assert leg is not None and leg.get_write_buffer_size() <= tcp.HIGH_WATER + (256 << 10)
        return read_to_eof(c), owner.sides[0].stays

    (got, stayed), owner = run(loop_name, relayed(backend, client, pipes=False))
    assert got == DOWN and stayed
    assert (owner.flows[0].bytes_in, owner.flows[0].bytes_out) == (len(UP), len(DOWN))
    assert owner.pipes_held == 0


def test_refused_pipes_keep_the_flow_on_the_event_loop(loop_name: str) -> None:
    def backend(conn: socket.socket) -> None:
        conn.sendall(DOWN)

    def client(c: socket.socket, owner: Owner) -> tuple[bytes, bool]:
        return read_to_eof(c), spliced(owner)

    (got, was_spliced), owner = run(loop_name, relayed(backend, client, pipes=False))
    assert not was_spliced and got == DOWN
    assert owner.flows[0].bytes_out == len(DOWN)


def test_small_messages_stay_on_the_event_loop(loop_name: str) -> None:
    def backend(conn: socket.socket) -> None:
        while msg := conn.recv(1024):
            conn.sendall(msg)

    def client(c: socket.socket, owner: Owner) -> bool:
        for i in range(500):
            msg = pattern(1024, i)
            c.sendall(msg)
            got = b""
            while len(got) < len(msg):
                got += c.recv(1024)
            assert got == msg
        return spliced(owner)

    was_spliced, owner = run(loop_name, relayed(backend, client))
    assert not was_spliced
    assert owner.flows[0].bytes_in == owner.flows[0].bytes_out == 500 * 1024


def _read_n(s: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        chunk = s.recv(min(1 << 18, n - got))
        assert chunk
        got += len(chunk)
    return got


def _ioctl(s: socket.socket, req: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), req, b"\0" * 4))[0])

