"""Leg and TcpEngine (usproxy/relay/tcp_engine.py): a socket as the transport the relay's protocols
expect, on both event loops, over real TCP on loopback.

Fault classes: the transport semantics the relay is built on (buffered writes when the kernel takes
part of them, pause_writing above the high-water mark and resume_writing at the low one, FIN only
after the buffered bytes, close only after them, abort dropping them, a peer's reset reported as
such, eof_received returning false closes), edge-triggered reading (the peer's FIN arriving in the
same edge as its last bytes must still be seen; bytes queued while reading was paused must be read
on resume, though no new edge comes), and descriptors (a socket handed over in a dup leaves the
epoll; a descriptor number reused within one batch of events gets none of the old socket's).
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

from usproxy.relay.tcp_engine import EDGE, HIGH_WATER, LOW_WATER, Leg, TcpEngine

T = TypeVar("T")


def run(loop_name: str, coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro) if loop_name == "uvloop" else asyncio.run(coro)


class Recorder(asyncio.Protocol):
    """Records what its Leg tells it; `keep_open` is what eof_received answers."""

    def __init__(self, keep_open: bool = True) -> None:
        self.events: list[Any] = []
        self.data = bytearray()
        self.keep_open = keep_open

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        self.events.append("eof")
        return self.keep_open

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(("lost", type(exc).__name__ if exc else None))


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback: (ours, the peer's), small buffers so writes fill them."""
    lsock = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(lsock.getsockname())
    ours, _ = lsock.accept()
    lsock.close()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return ours, peer


def leg_on(loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: asyncio.Protocol) -> Leg:
    engine = TcpEngine.of(loop)
    leg = Leg(engine, loop, sock, sock.getpeername(), protocol, HIGH_WATER, LOW_WATER)
    engine.register(leg.fd, EDGE, leg.event)
    return leg


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def drain(peer: socket.socket) -> bytes:
    """Everything up to the Leg's FIN."""
    peer.settimeout(10)
    out = bytearray()
    while chunk := peer.recv(1 << 16):
        out += chunk
    return bytes(out)


def test_writes_the_kernel_does_not_take_are_buffered_then_sent_then_fin(loop_name: str) -> None:
    big = os.urandom(4 * HIGH_WATER)

    async def main() -> tuple[bytes, list[Any], int]:
        loop = asyncio.get_running_loop()
        ours, peer = pair()
        p = Recorder()
        leg = leg_on(loop, ours, p)
        leg.write(big)  # far more than the socket takes: the rest is buffered, pause_writing
        buffered = leg.get_write_buffer_size()
        leg.write_eof()  # FIN after the buffered bytes, not before
        got = await asyncio.to_thread(drain, peer)
        await until(lambda: "resume" in p.events)
        leg.close()
        peer.close()
        return got, p.events, buffered

    got, events, buffered = run(loop_name, main())
    assert buffered > HIGH_WATER
    assert events[:2] == ["pause", "resume"]
    assert got == big  # every byte, in order, then the FIN
    assert events[-1] == ("lost", None)


def test_close_sends_the_buffer_first_and_abort_drops_it(loop_name: str) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        sizes = []
        for finish in ("close", "abort"):
            ours, peer = pair()
            leg = leg_on(loop, ours, Recorder())
            leg.write(os.urandom(2 * HIGH_WATER))
            assert leg.get_write_buffer_size()
            getattr(leg, finish)()
            try:
                sizes.append(len(await asyncio.to_thread(drain, peer)))
            except ConnectionResetError:  # abort: whatever was sent, then the close
                sizes.append(-1)
            peer.close()
        return sizes[0], sizes[1]

    closed, aborted = run(loop_name, main())
    assert closed == 2 * HIGH_WATER
    assert aborted < 2 * HIGH_WATER


def test_fin_in_the_same_edge_as_the_last_bytes_is_seen(loop_name: str) -> None:
    """The peer writes and shuts down before the Leg exists: one edge for both. The Leg must read
    the bytes and then the end of the stream (a short read is not the end here)."""
    async def main() -> tuple[bytes, list[Any]]:
        loop = asyncio.get_running_loop()
        ours, peer = pair()
        peer.sendall(b"last bytes")
        peer.shutdown(socket.SHUT_WR)
        time.sleep(0.05)  # both arrived
        p = Recorder(keep_open=False)
        leg_on(loop, ours, p)
        await until(lambda: ("lost", None) in p.events)
        peer.close()
        return bytes(p.data), p.events

    data, events = run(loop_name, main())
    assert data == b"last bytes"
    assert events == ["eof", ("lost", None)]  # eof_received false: closed


def test_bytes_queued_while_paused_are_read_on_resume(loop_name: str) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        ours, peer = pair()
        p = Recorder()
        leg = leg_on(loop, ours, p)
        leg.pause_reading()
        peer.sendall(b"x" * 1000)
        await asyncio.sleep(0.1)  # its edge came and went while paused
        before = len(p.data)
        leg.resume_reading()  # no new edge: the Leg reads by itself
        await until(lambda: len(p.data) == 1000)
        leg.close()
        peer.close()
        return before, len(p.data)

    assert run(loop_name, main()) == (0, 1000)


def test_a_peers_reset_is_reported_as_one(loop_name: str) -> None:
    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        ours, peer = pair()
        p = Recorder()
        leg_on(loop, ours, p)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()
        await until(lambda: bool(p.events))
        return p.events

    assert run(loop_name, main()) == [("lost", "ConnectionResetError")]


def test_an_aborted_leg_whose_socket_lives_on_in_a_dup_leaves_the_epoll(loop_name: str) -> None:
    """As a flow handed to splice: the socket is dup'd, the Leg aborted. close(2) of the original
    descriptor alone would leave the file registered (under the old number, reported to whatever
    takes that number next); the probe: the old number made to refer to the file again is no
    longer registered."""
    async def main() -> tuple[bool, list[Any], bytes]:
        loop = asyncio.get_running_loop()
        ours, peer = pair()
        p = Recorder()
        leg = leg_on(loop, ours, p)
        fd = ours.fileno()
        mine = socket.socket(ours.family, ours.type, ours.proto, os.dup(fd))
        leg.set_protocol(Recorder())
        leg.abort()
        os.dup2(mine.fileno(), fd)  # the old number: the same file again
        try:
            TcpEngine.of(loop).ep.unregister(fd)
            registered = True
        except OSError:
            registered = False
        os.close(fd)
        peer.sendall(b"for the dup")
        got = mine.recv(100)
        mine.close()
        peer.close()
        return registered, p.events, got

    registered, events, got = run(loop_name, main())
    assert not registered
    assert events == []  # the first protocol was let go before the abort
    assert got == b"for the dup"  # the connection lives on in the dup


def test_a_descriptor_reused_within_a_batch_gets_none_of_the_old_sockets_events(loop_name: str) -> None:
    """b's event comes first in a batch; its handler closes a and a new socket takes a's number.
    a's event, later in the same batch, must not reach the new socket's handler (it would take
    the old socket's readiness for its own)."""
    async def main() -> tuple[list[str], list[int], bool]:
        loop = asyncio.get_running_loop()
        engine = TcpEngine.of(loop)
        a, a_peer = pair()
        b, b_peer = pair()
        fd = a.fileno()
        calls: list[str] = []
        seen: list[int] = []
        made: list[socket.socket] = []

        def on_b(ev: int) -> None:
            calls.append("b")
            engine.forget(fd)
            a.close()
            spare: list[socket.socket] = []
            while not made:  # the lowest free number is taken first: take them up to fd
                new = socket.socket()
                (made if new.fileno() == fd else spare).append(new)
            for x in spare:
                x.close()
            made[0].bind(("127.0.0.1", 0))
            made[0].listen()  # a listener: no event of its own until a client comes
            engine.register(fd, select.EPOLLIN, lambda ev: seen.append(ev))

        # registered writable sockets are ready at once, in the order registered: b, then a
        engine.register(b.fileno(), EDGE, on_b)
        engine.register(a.fileno(), EDGE, lambda ev: calls.append("a"))
        events = engine.ep.poll(0)  # the batch the loop would dispatch, taken here to check its order
        order_ok = [f for f, _ in events] == [b.fileno(), fd]
        engine.ep = _Replay(engine.ep, events)  # type: ignore[assignment]
        engine._events()
        engine.ep = engine.ep.real  # type: ignore[attr-defined]
        for x in (*made, b, a_peer, b_peer):
            x.close()
        return calls, seen, order_ok

    calls, seen, order_ok = run(loop_name, main())
    assert order_ok  # the batch held b's event, then a's
    assert calls == ["b"]
    assert seen == []


class _Replay:
    """An epoll whose next poll returns `events` (a batch taken before), otherwise the real one."""

    def __init__(self, real: Any, events: list[tuple[int, int]]) -> None:
        self.real, self.events = real, events

    def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        events, self.events = self.events, []
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)
