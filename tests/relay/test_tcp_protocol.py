"""ClientSide/EndpointSide as state machines, with fake transports and a fake loop whose dials
wait for the test (a fake engine): events in, writes out.

Fault classes: EOF and flush ordering (C11) and bounded buffers on the paths a socket test cannot
reach on demand: bytes and a FIN that arrive before the endpoint connection exists are written in
order, FIN last; reading pauses once the dial buffer is full and resumes only when the endpoint
leg can take more; a pause caused by the very first write is not lost; an endpoint connection that
completes after its dial was given up (its client went away, or its timeout fired) never touches
the client, and a dial's timeout fires only while it is connecting.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import select
import socket
from collections.abc import Callable, Collection
from typing import Any, cast

import pytest

from usproxy.flows.flow_table import Flow, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.relay.flow_owner import FlowOwner
from usproxy.relay import tcp
from usproxy.relay.tcp import DIAL_BUFFER, HIGH_WATER, LOW_WATER, ClientSide, EndpointSide
from usproxy.model.types import Scope, ServicePortName

EP = Endpoint(ipaddress.ip_address("10.244.1.5"), 8080)
EP2 = Endpoint(ipaddress.ip_address("10.244.1.6"), 8080)


class FakeTransport:
    """Records what the protocol asks of it; `over_high_water` makes writes call pause_writing."""

    def __init__(self, peer: tuple[str, int], local: tuple[str, int]) -> None:
        self.extra: dict[str, Any] = {"peername": peer, "sockname": local, "socket": None}
        self.ops: list[Any] = []
        self.reading = True
        self.closing = False
        self.buffered = 0
        self.protocol: asyncio.Protocol | None = None
        self.over_high_water = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def write(self, data: bytes) -> None:
        self.ops.append(bytes(data))
        if self.over_high_water:
            self.buffered += len(data) + HIGH_WATER
            assert self.protocol is not None
            self.protocol.pause_writing()

    def write_eof(self) -> None:
        self.ops.append("EOF")

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        self.ops.append("CLOSE")

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (LOW_WATER, HIGH_WATER)


class FakeOwner:
    """A FlowOwner with `endpoints` (picked in order, none of `exclude`) that records what the
    protocol tells it."""

    spn = ServicePortName("default", "web", "http", "TCP")

    def __init__(self, endpoints: tuple[Endpoint, ...] = (EP, EP2)) -> None:
        self.endpoints = endpoints
        self.events: list[str] = []

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        return Flow(protocol, self.spn, client, frontend)

    def end_flow(self, flow: Flow) -> None:
        self.events.append("end")

    def pick(self, kind: Scope, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        return next((e for e in self.endpoints if e not in exclude), None)

    def failed(self, kind: Scope, ep: Endpoint) -> None:
        self.events.append(f"failed {ep}")

    def opened(self, kind: Scope, ep: Endpoint) -> None:
        self.events.append("opened")

    def closed(self, kind: Scope, ep: Endpoint) -> None:
        self.events.append("closed")

    def reserve_pipes(self) -> bool:
        return False

    def release_pipes(self) -> None:
        self.events.append("pipes released")


class FakeSocket:
    """A connecting socket of FakeEngine: `error` is what SO_ERROR will say."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.error = 0
        self.closed = False

    def fileno(self) -> int:
        return 1000

    def getsockopt(self, level: int, option: int) -> int:
        return self.error

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    """Dials that wait until the test connects them (`side.connection_made`, as the engine does
    once the socket is writable) or fails them (`fail`)."""

    def __init__(self) -> None:
        self.dials: list[tuple[FakeSocket, Callable[[int], None]]] = []

    def connect(self, host: str, port: int, handler: Callable[[int], None]) -> FakeSocket:
        self.dials.append((FakeSocket(host, port), handler))
        return self.dials[-1][0]

    def forget(self, fd: int) -> None:
        pass

    def fail(self, i: int, err: int = errno.ECONNREFUSED) -> None:
        sock, handler = self.dials[i]
        sock.error = err
        handler(select.EPOLLOUT | select.EPOLLERR)


async def accepted(owner: FlowOwner | None = None) -> tuple[ClientSide, FakeTransport]:
    """A ClientSide dialing its first endpoint on a FakeEngine: the test plays the endpoint's part."""
    client = ClientSide(owner or FakeOwner(), "cluster", ("10.96.10.10", 80), asyncio.get_running_loop(),
                        FakeEngine())  # type: ignore[arg-type]
    t = FakeTransport(("10.244.9.10", 40000), ("10.96.10.10", 80))
    t.protocol = client
    client.connection_made(t)  # type: ignore[arg-type]
    assert client.dialing is not None
    return client, t


def engine_of(client: ClientSide) -> FakeEngine:
    return cast(FakeEngine, client.engine)


def endpoint_leg(client: ClientSide, over_high_water: bool = False,
                 side: EndpointSide | None = None) -> tuple[EndpointSide, FakeTransport]:
    """The dial in progress (or `side`) connects: its connection_made, as the loop would run it."""
    side = side or client.dialing
    assert side is not None
    t = FakeTransport((side.endpoint.host, side.endpoint.port), ("10.244.0.1", 50000))
    t.protocol = side
    t.over_high_water = over_high_water
    side.connection_made(t)  # type: ignore[arg-type]
    return side, t


async def test_bytes_and_fin_before_the_endpoint_connects_are_flushed_in_order() -> None:
    client, ct = await accepted()
    chunks = [bytes([i]) * 100_000 for i in range(3)]
    for c in chunks:
        client.data_received(c)
    assert not ct.reading  # 300,000 bytes ≥ DIAL_BUFFER: reading paused
    assert 300_000 >= DIAL_BUFFER
    client.eof_received()
    _, ut = endpoint_leg(client)
    assert ut.ops == [b"".join(chunks), "EOF"]
    assert ct.reading


async def test_pause_from_the_first_write_is_kept() -> None:
    client, ct = await accepted()
    client.data_received(b"x" * DIAL_BUFFER)
    assert not ct.reading
    side, ut = endpoint_leg(client, over_high_water=True)
    assert not ct.reading  # the endpoint leg is over its high-water mark: stay paused
    ut.buffered = 0
    side.resume_writing()
    assert ct.reading


async def test_backpressure_both_ways() -> None:
    client, ct = await accepted()
    side, ut = endpoint_leg(client)
    side.pause_writing()
    assert not ct.reading
    side.resume_writing()
    assert ct.reading
    client.pause_writing()
    assert not ut.reading
    client.resume_writing()
    assert ut.reading


async def test_fin_each_way_then_both_legs_close() -> None:
    client, ct = await accepted()
    side, ut = endpoint_leg(client)
    client.data_received(b"request")
    client.eof_received()
    assert ut.ops == [b"request", "EOF"] and not ct.closing
    side.data_received(b"reply")
    side.eof_received()
    # the second FIN is the close's own (one shutdown(2) less per connection): on the wire the
    # same FIN after the reply, which test_c09_half_close and test_c11_flush_before_fin check
    assert ct.ops == [b"reply", "CLOSE"]
    assert ut.ops[-1] == "CLOSE"


async def test_endpoint_connected_after_the_client_left_never_touches_it() -> None:
    owner = FakeOwner()
    client, ct = await accepted(owner)
    dialing = client.dialing
    assert dialing is not None
    client.connection_lost(ConnectionResetError())
    assert dialing.abandoned and client.dialing is None
    assert engine_of(client).dials[0][0].closed  # the connecting socket is closed at once
    ops_before = list(ct.ops)
    side, ut = endpoint_leg(client, side=dialing)  # a connection_made that still came
    assert ut.closing  # the late connection is closed at once
    side.data_received(b"stale")
    side.eof_received()
    side.connection_lost(None)
    assert ct.ops == ops_before
    assert owner.events.count("opened") == 0
    assert not any(e.startswith("failed") for e in owner.events)  # the endpoint did nothing wrong


async def test_a_dial_that_times_out_is_given_up_and_the_next_endpoint_dialed(monkeypatch: pytest.MonkeyPatch) -> None:
    """At its timeout a dial's socket is closed and the next endpoint is dialed; a connection_made
    for the first one (were its connect to complete in the same turn) never attaches: the client
    stays untouched."""
    monkeypatch.setattr(tcp, "DIAL_TIMEOUTS", (0.01, 5.0))
    owner = FakeOwner()
    client, ct = await accepted(owner)
    first = client.dialing
    assert first is not None and first.endpoint == EP
    await asyncio.sleep(0.05)  # the first dial's timeout fires
    assert first.abandoned and owner.events == [f"failed {EP}"] and engine_of(client).dials[0][0].closed
    assert client.dialing is not None and client.dialing.endpoint == EP2
    late, lt = endpoint_leg(client, side=first)
    assert not late.attached and client.upstream is None and lt.closing
    late.data_received(b"late")
    assert ct.ops == [] and owner.events.count("opened") == 0
    side, _ = endpoint_leg(client)  # the second endpoint answers
    assert side.attached and client.upstream is side and client.endpoint == EP2


async def test_endpoint_connected_in_time_stops_the_dial_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "DIAL_TIMEOUTS", (0.05, 5.0))
    owner = FakeOwner()
    client, ct = await accepted(owner)
    side, _ = endpoint_leg(client)
    await asyncio.sleep(0.1)  # past the timeout: it must not fire any more
    assert side.attached and client.upstream is side and side.timer is None
    assert not any(e.startswith("failed") for e in owner.events)
    side.data_received(b"reply")
    assert ct.ops == [b"reply"]


async def test_a_refused_dial_tries_the_next_endpoint_then_gives_the_client_up() -> None:
    owner = FakeOwner()
    client, ct = await accepted(owner)
    engine = engine_of(client)
    engine.fail(0)
    assert owner.events == [f"failed {EP}"] and engine.dials[0][0].closed
    assert client.dialing is not None and client.dialing.endpoint == EP2
    engine.fail(1)
    assert owner.events == [f"failed {EP}", f"failed {EP2}"]
    assert client.dialing is None and ct.ops == ["CLOSE"]  # no endpoint left: reset (SO_LINGER 0 + close)


async def test_the_endpoint_legs_keepalive_is_left_to_the_relays_sweep() -> None:
    """SO_KEEPALIVE on the endpoint leg is not set per connection but by `Flow.settle`, which the
    relay's sweep runs on flows still live then (Relay.settle_tcp)."""
    client, _ = await accepted()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        side = client.dialing
        assert side is not None
        t = FakeTransport((str(EP.ip), EP.port), ("10.244.0.1", 50000))
        t.extra["socket"] = sock
        t.protocol = side
        side.connection_made(t)  # type: ignore[arg-type]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert client.flow is not None and client.flow.settle is not None
        client.flow.settle()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
