"""What one relayed TCP connection costs the event loop (issue 30 item 3), on both loops, through
the relay's own listener and protocols on loopback.

Fault classes: per-connection work whose answer is known (a running-loop lookup per connection, a
Task and a timeout object per dial), a finished connection that only the cyclic garbage collector
can free (a reference cycle between the connection and its flow), write-buffer limits that are
not the ones the relay's backpressure is written for, and the dial driven without a Task: a
refused endpoint and a timed-out one are each followed by the next endpoint, and a client that
leaves while its dial is pending leaves no descriptor behind and no endpoint marked failed.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import uvloop

from usproxy.flows.flow_table import Flow, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import Scope, ServicePortName
from usproxy.relay import tcp
from usproxy.relay.tcp import HIGH_WATER, LOW_WATER, ClientSide, EndpointSide, client_factory
from usproxy.relay.tcp_listener import TcpListener

T = TypeVar("T")
REQUEST, REPLY = b"q" * 64, b"r" * 64


def run(loop_name: str, coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro) if loop_name == "uvloop" else asyncio.run(coro)


def loopback(port: int) -> Endpoint:
    return Endpoint(ipaddress.ip_address("127.0.0.1"), port)


class Owner:
    """A FlowOwner over loopback endpoints, picked in order (none of `exclude`); it counts flows
    and records failures, and keeps no reference to a flow after its end."""

    spn = ServicePortName("default", "cost", "tcp", "TCP")

    def __init__(self, *endpoints: Endpoint) -> None:
        self.endpoints = endpoints
        self.failures: list[Endpoint] = []
        self.live = self.ended = 0

    def pick(self, kind: Scope, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        return next((e for e in self.endpoints if e not in exclude), None)

    def failed(self, kind: Scope, ep: Endpoint) -> None:
        self.failures.append(ep)

    def opened(self, kind: Scope, ep: Endpoint) -> None:
        pass

    def closed(self, kind: Scope, ep: Endpoint) -> None:
        pass

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        self.live += 1
        return Flow(protocol, self.spn, client, frontend)

    def end_flow(self, flow: Flow) -> None:
        self.live -= 1
        self.ended += 1

    def reserve_pipes(self) -> bool:
        return False

    def release_pipes(self) -> None:
        pass


def serve(answer: bool = True) -> tuple[socket.socket, threading.Thread]:
    """A loopback endpoint in a thread: reads REQUEST, answers REPLY, closes first (as bench's
    short connections). Returns its listening socket (closed by the caller) and the thread."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def loop() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                got = b""
                while len(got) < len(REQUEST) and (chunk := conn.recv(4096)):
                    got += chunk
                if answer:
                    conn.sendall(REPLY)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    return lsock, th


def blackhole() -> tuple[socket.socket, socket.socket]:
    """A loopback port whose SYNs are dropped: a listener with a full accept queue (backlog 0,
    one connection queued and never accepted). Returns (listener, the queued connection)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    filler = socket.create_connection(lsock.getsockname(), timeout=5)
    return lsock, filler


def closed_port() -> int:
    """A loopback port nothing listens on (connect: ECONNREFUSED)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exchange(port: int) -> bytes:
    """One short connection through the relay: REQUEST, then everything up to the relay's FIN."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(REQUEST)
        out = b""
        while chunk := c.recv(4096):
            out += chunk
        return out


async def listening(owner: Owner) -> tuple[TcpListener, int]:
    listener = await TcpListener.open("127.0.0.1", 0, client_factory(owner, "cluster", ("127.0.0.1", 0)))
    return listener, int(listener.sock.getsockname()[1])


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def counted_loop_lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the Python-level running-loop lookups (asyncio.get_running_loop, which
    asyncio.timeout and asyncio's helpers call; each is a getpid(2) in Python 3.11) while the
    list holds a 1 at its head; the count is its second item."""
    counts = [0, 0]
    real = asyncio.events.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        if counts[0]:
            counts[1] += 1
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    monkeypatch.setattr(asyncio.events, "get_running_loop", counting)
    yield counts


def test_a_connection_asks_for_no_running_loop_and_makes_no_task(loop_name: str, counted_loop_lookups: list[int]) -> None:
    """From accept to both legs closed, only the relay's callbacks run on the loop (the client is
    a thread, this test waits on one future): they look the running loop up zero times and start
    no task (not for the accept, the dial or its timeout)."""
    async def main() -> tuple[bytes, set[str], int]:
        loop = asyncio.get_running_loop()
        server, _ = serve()
        owner = Owner(loopback(server.getsockname()[1]))
        listener, port = await listening(owner)
        me = asyncio.current_task()
        tasks: set[str] = set()
        finished: asyncio.Future[bytes] = loop.create_future()

        def sample() -> None:  # what tasks exist, every 2 ms while the connection runs
            tasks.update(getattr(t.get_coro(), "__qualname__", "?") for t in asyncio.all_tasks(loop) if t is not me)
            if not finished.done():
                loop.call_later(0.002, sample)

        def client() -> None:
            got = exchange(port)
            while owner.ended == 0:  # both legs closed
                time.sleep(0.002)
            loop.call_soon_threadsafe(finished.set_result, got)

        try:
            counted_loop_lookups[0] = 1
            loop.call_soon(sample)
            threading.Thread(target=client).start()
            got = await finished
            counted_loop_lookups[0] = 0
            return got, tasks, counted_loop_lookups[1]
        finally:
            listener.close()
            server.close()

    got, tasks, lookups = run(loop_name, main())
    assert got == REPLY
    assert lookups == 0
    assert tasks == set()


def test_a_finished_connection_leaves_no_reference_cycle(loop_name: str) -> None:
    """Everything of a relayed connection (both protocols, the flow, the dial) is freed by
    reference counting when it ends: nothing for the cyclic collector to find."""
    async def main() -> tuple[bytes, list[str]]:
        server, _ = serve()
        owner = Owner(loopback(server.getsockname()[1]))
        listener, port = await listening(owner)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            got = await asyncio.to_thread(exchange, port)
            await until(lambda: owner.ended == 1)
            await asyncio.sleep(0.05)  # both legs' connection_lost ran
            gc.collect()
            kinds = (ClientSide, EndpointSide, Flow)
            return got, sorted({type(o).__name__ for o in gc.garbage if isinstance(o, kinds)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            listener.close()
            server.close()

    got, cyclic = run(loop_name, main())
    assert got == REPLY
    assert cyclic == []


def test_write_buffer_limits_are_the_relays_without_a_call_per_connection(loop_name: str) -> None:
    """The relay's backpressure (HIGH_WATER, LOW_WATER per leg) is the loops' default, so no
    connection sets it: both legs of a relayed connection have it."""
    async def main() -> list[tuple[int, int]]:
        server, _ = serve(answer=False)
        owner = Owner(loopback(server.getsockname()[1]))
        sides: list[ClientSide] = []
        factory = client_factory(owner, "cluster", ("127.0.0.1", 0))

        def recording() -> ClientSide:
            sides.append(factory())
            return sides[-1]

        listener = await TcpListener.open("127.0.0.1", 0, recording)
        try:
            with socket.create_connection(listener.sock.getsockname(), timeout=5):
                await until(lambda: bool(sides) and sides[0].upstream is not None)
                legs = [sides[0].transport, sides[0].upstream.transport]  # type: ignore[union-attr]
                limits = [leg.get_write_buffer_limits() for leg in legs if leg is not None]
            await until(lambda: owner.ended == 1)
            return limits
        finally:
            listener.close()
            server.close()

    assert run(loop_name, main()) == [(LOW_WATER, HIGH_WATER)] * 2


def test_a_refused_then_a_silent_endpoint_are_each_followed_by_the_next(loop_name: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "DIAL_TIMEOUTS", (5.0, 0.2, 5.0))

    async def main() -> tuple[bytes, list[Endpoint], list[Endpoint]]:
        server, _ = serve()
        hole, filler = blackhole()
        refused, silent = loopback(closed_port()), loopback(hole.getsockname()[1])
        owner = Owner(refused, silent, loopback(server.getsockname()[1]))
        listener, port = await listening(owner)
        try:
            got = await asyncio.to_thread(exchange, port)
            await until(lambda: owner.ended == 1)
            return got, owner.failures, [refused, silent]
        finally:
            listener.close()
            server.close()
            filler.close()
            hole.close()

    got, failures, expected = run(loop_name, main())
    assert got == REPLY
    assert failures == expected


def test_a_client_leaving_during_its_dial_leaves_no_descriptor(loop_name: str) -> None:
    async def main() -> tuple[int, int, list[Endpoint], int]:
        hole, filler = blackhole()
        owner = Owner(loopback(hole.getsockname()[1]))
        listener, port = await listening(owner)
        try:
            before = len(os.listdir("/proc/self/fd"))
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            await until(lambda: owner.live == 1)  # accepted; its dial waits on the silent endpoint
            during = len(os.listdir("/proc/self/fd"))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()  # a reset: the relay's client leg ends at once
            await until(lambda: owner.live == 0)
            await asyncio.sleep(0.05)  # the cancelled dial resumes and closes its socket
            return before, during, owner.failures, len(os.listdir("/proc/self/fd"))
        finally:
            listener.close()
            filler.close()
            hole.close()

    before, during, failures, after = run(loop_name, main())
    assert during >= before + 3  # the client, the accepted leg, the pending dial
    assert after == before
    assert failures == []  # the endpoint was not at fault
