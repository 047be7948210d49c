"""The TCP relay: one ClientSide and one EndpointSide asyncio Protocol per connection.

Events in, writes out; no Streams on the hot path. Invariants:
- Backpressure both ways: when one side's transport is over its high-water mark
  (`pause_writing`), the other side stops reading until `resume_writing`. Data that arrives before
  the endpoint connection exists is buffered up to DIAL_BUFFER bytes, then reading pauses.
- Half-close per direction: EOF from one side becomes `write_eof()` on the other, which the loop
  sends only after the buffered data (FIN after the last byte, C09/C11). Both EOFs seen: both legs
  close. The second EOF skips its `write_eof()`: the close that follows at once sends the same FIN
  after the same buffered bytes (and no RST: that leg's peer sent FIN, so nothing is left unread),
  one shutdown(2) less per connection.
- A reset on one side is passed on as a reset (SO_LINGER 0) after the bytes already received from
  it have been handed to the kernel. The relay's own resets (idle timeouts, the relay stopping)
  set SO_LINGER 0 on both legs before closing either: a Leg's close ends the other leg at once.
- Both legs are Legs of the loop's TcpEngine (tcp_engine.py: the relay's own epoll, no transport
  of the loop; issue 30), but any asyncio transport works (tests relay through a loop's own).
- Dials never block accepting: each starts from the client's `connection_made` with bounded
  timeouts (kube-proxy userspace's 250 ms, 500 ms, 1 s, 2 s, pkg/proxy/userspace/proxysocket.go
  tryConnect), and a refused or timed-out endpoint is retried on the next one (C14). Each attempt
  is an EndpointSide: a non-blocking connect(2) on the engine's epoll under one timer handle
  (`call_later`); no Task, no asyncio.timeout, no running-loop lookup per connection (issue 30:
  five getpid(2) per connection in Python 3.11, and their objects). Giving an attempt up (its
  timeout, or the client leaving) closes its socket; it never attaches. An EndpointSide stops its
  timer and attaches itself to its client in `connection_made`, so no byte from an endpoint
  arrives before the client knows its upstream.
- Data that arrived during the dial is written first, then the client's FIN if it came; reading
  resumes only if the dial buffer paused it and the endpoint leg is under its high-water mark.
- Bulk flows leave the transports for splice(2) (tcp_splice.py, issue 17): after BULK_STREAK reads
  in a row of BULK_READ bytes or more in one direction, with no FIN seen yet and the pipes' four
  descriptors within the budget (`FlowOwner.reserve_pipes`; else the flow stays here). Both legs
  stop reading and their write limits drop to 0, so `resume_writing` says when a leg's buffer is
  empty; with both empty (no byte left in userspace: every read was written), the sockets are
  dup()'d and the transports, switched to a protocol that ignores their end, aborted (an abort
  of an empty buffer sends nothing and closes only the transport's descriptor, which a Leg takes
  out of the engine's epoll first; readiness is then watched on the dup). Small messages never
  make a streak and keep this path. A hand-over still waiting after HANDOVER_WAIT (a peer that
  reads only after it wrote everything keeps its leg's buffer full, and the paused other direction
  would then never drain) is given up: both legs resume, and the flow stays here for good.
- Per connection nothing is asked of the kernel or the loop whose answer is known (issue 30): the
  loop and engine come with the listener's factory (`client_factory`), the client's address from
  accept(2), the frontend's is the listener's, the endpoint's local address is read only when
  /flows shows it, write-buffer limits are set only on a transport whose default differs
  (`tune`), and SO_KEEPALIVE and TCP_NODELAY are inherited from the listener (client leg), or set
  by the relay's sweep on flows still live (SO_KEEPALIVE, endpoint leg).
  Both protocols are slotted, and a finished connection leaves no reference cycle (the flow's
  callbacks are dropped at its end), so it is freed at once, not by the cyclic collector.
"""

from __future__ import annotations

import _socket
import asyncio
import logging
import os
import select
import socket
import struct
from collections.abc import Callable

from usproxy.flows.flow_table import Flow, FlowTableFull, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.relay import tcp_splice
from usproxy.model.types import Scope
from usproxy.relay.flow_owner import FlowOwner, SourceRefused
from usproxy.relay.tcp_engine import HIGH_WATER, LOW_WATER, READABLE, Leg, TcpEngine
from usproxy.relay.tcp_splice import LINGER_ZERO, SplicedFlow

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)
DIAL_BUFFER = 256 * 1024
# HIGH_WATER (64 KiB) and LOW_WATER (16 KiB) per leg, tcp_engine.py's: as HAProxy's 16 KiB buffers,
# the kernel's socket buffers (bounded by tcp_mem) hold the rest.
__all__ = ["HIGH_WATER", "LOW_WATER", "ClientSide", "EndpointSide", "client_factory"]
BULK_READ = 64 * 1024  # a read this large means the sender outruns us: both loops read up to 256 KiB
BULK_STREAK = 4  # such reads in a row in one direction make the flow bulk (spliced)
HANDOVER_WAIT = 1.0  # seconds a hand-over to splice may wait for empty buffers
SPLICE = tcp_splice.available()  # tests may turn it off
TCPI_LAST_ACK_RECV = 56  # offset of tcpi_last_ack_recv (u32, ms) in Linux's struct tcp_info


# transport type -> its default write-buffer limits are the relay's (a Leg's are: it is made with them)
_DEFAULT_LIMITS: dict[type, bool] = {Leg: True}


def tune(transport: asyncio.Transport) -> None:
    """Write-buffer limits HIGH_WATER and LOW_WATER on a new leg, unless its loop's default is
    that already (asyncio's is; uvloop's low-water mark is 16 bytes, not 16 KiB): known once per
    transport type, so asyncio pays no call per connection."""
    kind = type(transport)
    ok = _DEFAULT_LIMITS.get(kind)
    if ok is None:
        ok = _DEFAULT_LIMITS[kind] = transport.get_write_buffer_limits() == (LOW_WATER, HIGH_WATER)
    if not ok:
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)


def keepalive(transport: asyncio.BaseTransport) -> None:
    """SO_KEEPALIVE on an endpoint connection, so a long-idle flow to a vanished endpoint ends.
    (TCP_NODELAY the loop sets on every TCP transport.)"""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass


def ack_age(transport: asyncio.BaseTransport | None) -> float | None:
    """Seconds since the connection last received an ACK (keepalive answers count, as they keep a
    kernel conntrack entry alive), from TCP_INFO; None when the kernel does not say."""
    return socket_ack_age(transport.get_extra_info("socket") if transport is not None else None)


def socket_ack_age(sock: socket.socket | None) -> float | None:
    """`ack_age` of a socket (None: none, or the kernel does not say)."""
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < TCPI_LAST_ACK_RECV + 4:
        return None
    return float(struct.unpack_from("I", info, TCPI_LAST_ACK_RECV)[0]) / 1000


def reset(transport: asyncio.WriteTransport) -> None:
    """Close with RST once our userspace buffer is flushed (SO_LINGER 0)."""
    linger_zero(transport)
    transport.close()


def linger_zero(transport: asyncio.BaseTransport) -> None:
    """SO_LINGER 0 on the transport's socket: its close, whenever it comes, sends RST."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_ZERO)
    except OSError:
        pass


def client_factory(owner: FlowOwner, kind: Scope, frontend: HostPort) -> Callable[[], ClientSide]:
    """The protocol factory of a listener on `frontend` (called in the loop that will run it)."""
    loop = asyncio.get_running_loop()
    engine = TcpEngine.of(loop)
    return lambda: ClientSide(owner, kind, frontend, loop, engine)


class ClientSide(asyncio.Protocol):
    """The accepted connection from the client to ClusterIP:port (or NodePort).

    It owns the flow, the dial and the client's transport. Its EndpointSide reaches it only
    through `attach`, `dial_failed`, `reply`, `reply_eof`, `upstream_lost`, `pause_reading` and
    `resume_reading`.
    """

    __slots__ = ("owner", "kind", "frontend", "loop", "engine", "transport", "upstream", "flow", "pending", "held",
                 "eof_in", "eof_out", "dialing", "tried", "endpoint", "closed", "streak_in", "streak_out",
                 "splicing", "pipes_held", "spliced", "handover_timer", "stays")

    def __init__(self, owner: FlowOwner, kind: Scope, frontend: HostPort,
                 loop: asyncio.AbstractEventLoop | None = None, engine: TcpEngine | None = None) -> None:
        self.owner = owner
        self.kind: Scope = kind
        self.frontend = frontend  # the listener's address: no getsockname per connection
        self.loop = loop  # None: the running loop (and its engine), looked up in connection_made
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.upstream: EndpointSide | None = None  # set by `attach`
        self.flow: Flow | None = None
        self.pending = bytearray()
        self.held = False  # reading paused because `pending` is full (not for backpressure)
        self.eof_in = False  # client sent FIN
        self.eof_out = False  # endpoint sent FIN
        self.dialing: EndpointSide | None = None  # the attempt in progress
        self.tried: tuple[Endpoint, ...] = ()  # endpoints dialed for this connection, in order
        self.endpoint: Endpoint | None = None
        self.closed = False
        self.streak_in = self.streak_out = 0  # reads of BULK_READ or more in a row, each way
        self.splicing = False  # handing over to splice: both legs paused, waiting for empty buffers
        self.pipes_held = False  # the pipes' descriptors are reserved (`owner.reserve_pipes`)
        self.spliced: SplicedFlow | None = None
        self.handover_timer: asyncio.TimerHandle | None = None
        self.stays = False  # a hand-over was given up: no second try

    # -- client events -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are no asyncio.Transport subclasses; no cast(): a call per connection)
        t: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport = t
        tune(t)
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.engine is None:
            self.engine = TcpEngine.of(self.loop)
        client = t.get_extra_info("peername")
        if client is None:  # reset before we got to it: nothing to relay
            t.abort()
            return
        try:
            peer = client if len(client) == 2 else (client[0], client[1])  # (IPv6's has four items)
            self.flow = flow = self.owner.new_flow("TCP", peer, self.frontend)
        except FlowTableFull:
            limited.warning("flow table full: refusing %s", self.owner.spn)
            reset(t)
            return
        except SourceRefused:  # its SYN passed before the socket filter was in place: no dial
            reset(t)
            return
        flow.state = "SYN_SENT"
        flow.closer = self.expire
        flow.liveness = self.ack_age
        self._dial()

    def data_received(self, data: bytes) -> None:
        if self.flow is not None:
            self.flow.seen_in(len(data))
        up = self.upstream
        if up is not None:
            up.transport.write(data)  # type: ignore[union-attr]  # (attached: it has one)
            if len(data) >= BULK_READ:
                self.streak_in += 1
                if self.streak_in >= BULK_STREAK:
                    self.go_bulk()
            elif self.streak_in:
                self.streak_in = 0
            return
        self.pending += data
        if len(self.pending) >= DIAL_BUFFER and self.transport is not None and not self.held:
            self.held = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof_in = True
        if self.upstream is not None:
            if not self.eof_out:  # else _maybe_finish closes both legs: close sends the FIN
                self.upstream.send_eof()
            self._maybe_finish()
        return True  # else `attach` sends the FIN after the buffered bytes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.dialing is not None:
            self.dialing.abandon()
            self.dialing = None
        up = self.upstream
        if up is not None and exc is not None:
            up.reset()
        elif up is not None:
            up.close()
        self._release()
        if up is None or up.lost:
            self.upstream = None  # break the ClientSide <-> EndpointSide cycle: no GC needed

    def ack_age(self) -> float | None:
        """Seconds since either leg last received an ACK (None: unknown)."""
        if self.spliced is not None:
            both = [socket_ack_age(s) for s in self.spliced.sockets]
        else:
            both = [ack_age(self.transport), ack_age(self.upstream.transport if self.upstream else None)]
        ages = [a for a in both if a is not None]
        return min(ages) if ages else None

    def expire(self) -> None:
        """The flow idled past its timeout: reset both legs (each then sees connection_lost)."""
        if self.spliced is not None:
            self.spliced.expire()
            return
        # Both sockets linger 0 before either closes: a leg's close runs the other's end at
        # once (a Leg's connection_lost is synchronous), and that must be a reset too.
        legs = [t for t in (self.transport, self.upstream.transport if self.upstream else None)
                if t is not None and not t.is_closing()]
        for t in legs:
            linger_zero(t)
        for t in legs:
            t.close()

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.splicing:
            self._handover_soon()
        elif self.upstream is not None:
            self.upstream.resume_reading()

    # -- what its EndpointSide may ask ---------------------------------------------------------
    def attach(self, side: EndpointSide) -> bool:
        """`side` is connected to its endpoint: make it this connection's upstream and hand it
        what the client sent meanwhile (bytes, then FIN). False, and `side` closed, when the
        client is gone (a dial that completed after its client left never touches it)."""
        if self.dialing is side:
            self.dialing = None
        if self.closed or self.transport is None or self.transport.is_closing():
            side.close()
            return False
        ep = side.endpoint
        self.endpoint = ep
        self.owner.opened(self.kind, ep)
        self.upstream = side
        if self.flow is not None:
            self.flow.endpoint = (ep.host, ep.port)
            self.flow.local_of = side.transport  # its address is read only when flows are shown
            self.flow.settle = side.keepalive
            self.flow.state = "ESTABLISHED"
        if self.pending:
            side.send(bytes(self.pending))
            self.pending.clear()
        if self.held and not side.over_high_water():
            self.transport.resume_reading()  # else the side's resume_writing resumes it
        self.held = False
        if self.eof_in:
            side.send_eof()
            self._maybe_finish()  # the client's FIN came during the dial: the flow is half-closed
        return True

    def reply(self, data: bytes) -> None:
        """Endpoint → client bytes."""
        if self.flow is not None:
            self.flow.seen_out(len(data))
        if self.transport is not None:
            self.transport.write(data)
        if len(data) >= BULK_READ:
            self.streak_out += 1
            if self.streak_out >= BULK_STREAK:
                self.go_bulk()
        elif self.streak_out:
            self.streak_out = 0

    def reply_eof(self) -> None:
        """The endpoint sent FIN: pass it on after the bytes before it."""
        self.eof_out = True
        if self.transport is not None and not self.transport.is_closing() and not self.eof_in:
            self.transport.write_eof()  # (both EOFs seen: _maybe_finish's close sends the FIN)
        self._maybe_finish()

    def upstream_lost(self, side: EndpointSide, exc: Exception | None) -> None:
        """The endpoint connection ended: end the client's too (a reset as a reset)."""
        t = self.transport
        if t is not None and not t.is_closing():
            if exc is not None:
                reset(t)
            else:
                t.close()
        if self.closed and self.upstream is side:
            self.upstream = None  # break the cycle (the client side went first)

    def pause_reading(self) -> None:
        """The endpoint leg is over its high-water mark: stop reading the client."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.splicing:
            self._handover_soon()
        elif self.transport is not None:
            self.transport.resume_reading()

    # -- splice (see the module docstring) -----------------------------------------------------
    def go_bulk(self) -> None:
        """The flow is bulk: start handing it over to splice, unless it is half-closed, closing,
        handing over already, or the pipes' descriptors do not fit the budget (then it stays
        here, and tries again after another streak)."""
        self.streak_in = self.streak_out = 0
        up, t = self.upstream, self.transport
        if (self.splicing or self.stays or not SPLICE or up is None or up.transport is None or t is None
                or self.eof_in or self.eof_out or t.is_closing() or up.transport.is_closing()):
            return
        if not self.owner.reserve_pipes():
            return
        self.pipes_held = self.splicing = True
        for leg in (t, up.transport):
            leg.pause_reading()
            leg.set_write_buffer_limits(high=0, low=0)  # resume_writing once it is empty
        assert self.loop is not None
        self.handover_timer = self.loop.call_later(HANDOVER_WAIT, self._cancel_handover)
        self._handover_soon()

    def _handover_soon(self) -> None:
        # Out of the transport's own callback: its write path still runs after resume_writing.
        assert self.loop is not None
        self.loop.call_soon(self._handover)

    def _handover(self) -> None:
        """Both legs' buffers empty: take the sockets and start splicing. A leg closing meanwhile
        ends the hand-over: its connection_lost tears the flow down as usual."""
        up, t = self.upstream, self.transport
        if self.spliced is not None or self.closed or up is None or up.transport is None or t is None:
            return
        ut = up.transport
        if t.is_closing() or ut.is_closing() or t.get_write_buffer_size() or ut.get_write_buffer_size():
            return  # a resume_writing comes when it is empty
        try:
            pipes = (tcp_splice.pipe(), tcp_splice.pipe())
        except OSError as err:
            limited.warning("%s: no pipe for a bulk flow (%s); it stays on the event loop", self.owner.spn, err)
            self._cancel_handover()
            return
        if self.flow is not None and self.flow.local is None:
            name = ut.get_extra_info("sockname")
            self.flow.local, self.flow.local_of = ((name[0], name[1]) if name else None), None
        up.attached = False  # the endpoint side hears nothing more
        self._stop_handover_timer()
        assert self.loop is not None
        self.spliced = SplicedFlow(self.loop, _take(t), _take(ut), self.flow, pipes, self._spliced_done)
        self.splicing = False
        if self.flow is not None and self.flow.settle is not None:
            self.flow.settle = self.spliced.keepalive
        self.spliced.start()

    def _cancel_handover(self) -> None:
        """Give the hand-over up (no pipe, or HANDOVER_WAIT passed): both legs as before."""
        self._stop_handover_timer()
        if not self.splicing or self.closed:
            return
        self.splicing = False
        self.stays = True
        self._give_back_pipes()
        legs = [t for t in (self.transport, self.upstream.transport if self.upstream else None)
                if t is not None and not t.is_closing()]
        for leg in legs:
            leg.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        # A leg with bytes left is paused in its transport's eyes since the limits were 0: its
        # resume_writing (at LOW_WATER now) resumes the other, and no new pause_writing would
        # come if that one read on now. A leg with none is not paused: the other may read.
        for leg in legs:
            if all(o is leg or not o.get_write_buffer_size() for o in legs):
                leg.resume_reading()

    def _stop_handover_timer(self) -> None:
        if self.handover_timer is not None:
            self.handover_timer.cancel()
            self.handover_timer = None

    def _spliced_done(self) -> None:
        self._release()
        self.upstream = None  # break the cycle: neither transport calls back any more

    def _give_back_pipes(self) -> None:
        if self.pipes_held:
            self.pipes_held = False
            self.owner.release_pipes()

    # -- dialing -------------------------------------------------------------------------------
    def _dial(self) -> None:
        """Dial the next endpoint (none of `tried`), or give the client up when there is none or
        every timeout of DIAL_TIMEOUTS was used."""
        loop, engine, n = self.loop, self.engine, len(self.tried)
        ep = None
        if n < len(DIAL_TIMEOUTS) and loop is not None and engine is not None and self.flow is not None:
            ep = self.owner.pick(self.kind, self.flow.client[0], self.tried)
        if ep is None:
            if self.flow is not None:
                limited.warning("%s: no endpoint answered for %s", self.owner.spn, self.flow.client[0])
            if self.transport is not None:
                reset(self.transport)
            return
        assert loop is not None and engine is not None
        self.tried += (ep,)
        self.dialing = side = EndpointSide(self, ep)
        side.dial(loop, engine, DIAL_TIMEOUTS[n])

    def dial_failed(self, side: EndpointSide, err: BaseException) -> None:
        """`side`'s dial failed (refused, unreachable, timed out): back off from its endpoint and
        try the next one."""
        if side is not self.dialing or self.closed:
            return
        self.dialing = None
        limited.warning("%s: endpoint %s failed (%s); trying the next", self.owner.spn, side.endpoint,
                        type(err).__name__ if isinstance(err, TimeoutError) else err)
        self.owner.failed(self.kind, side.endpoint)
        self._dial()

    # -- teardown ------------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        if self.flow is not None:
            self.flow.state = "FIN_WAIT" if not (self.eof_in and self.eof_out) else "CLOSING"
        if self.eof_in and self.eof_out:
            if self.transport is not None:
                self.transport.close()
            if self.upstream is not None:
                self.upstream.close()

    def _release(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.handover_timer is not None:
            self._stop_handover_timer()
        if self.pipes_held:
            self._give_back_pipes()
        flow = self.flow
        if flow is not None:
            self.owner.end_flow(flow)
            flow.closer = flow.liveness = flow.settle = None  # they refer back here: no cycle left
        if self.endpoint is not None:
            self.owner.closed(self.kind, self.endpoint)


class _Detached(asyncio.Protocol):
    """The protocol of a transport whose socket was taken for splicing: its end is no news."""


def _take(transport: asyncio.Transport) -> socket.socket:
    """The transport's socket as a socket of our own (a dup of its descriptor), and the transport
    aborted: its write buffer is empty (the caller checked), so no byte is lost, and closing its
    descriptor leaves the connection open (the dup holds it)."""
    sock = transport.get_extra_info("socket")
    mine = socket.socket(sock.family, sock.type, sock.proto, os.dup(sock.fileno()))
    mine.setblocking(False)
    transport.set_protocol(_Detached())
    transport.abort()
    return mine


class EndpointSide(asyncio.Protocol):
    """One dial of an endpoint for a ClientSide, then the proxy's connection to it.

    It owns the dial (a connecting socket on the engine, and its timer) and then the endpoint's
    Leg. It attaches itself to its ClientSide in `connection_made`, so no byte can arrive before
    the client knows its upstream; a side given up (timed out, or its client went away) never
    touches the client. Its ClientSide reaches it only through `abandon`, `send`, `send_eof`,
    `close`, `reset`, `pause_reading`, `resume_reading` and `over_high_water`.
    """

    __slots__ = ("client", "endpoint", "transport", "attached", "lost", "connecting", "timer", "abandoned")

    def __init__(self, client: ClientSide, endpoint: Endpoint) -> None:
        self.client = client
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.attached = False
        self.lost = False
        self.connecting: _socket.socket | None = None  # the socket, until connected or given up
        self.timer: asyncio.TimerHandle | None = None  # the dial's timeout
        self.abandoned = False  # given up: never attaches

    # -- the dial ------------------------------------------------------------------------------
    def dial(self, loop: asyncio.AbstractEventLoop, engine: TcpEngine, timeout: float) -> None:
        """Connect to the endpoint within `timeout` seconds; the client hears `attach` (from
        `connection_made`) or `dial_failed`."""
        try:
            self.connecting = engine.connect(self.endpoint.host, self.endpoint.port, self._connect_event)
        except OSError as err:  # refused at once (unreachable, out of descriptors, ...)
            self.abandoned = True
            self.client.dial_failed(self, err)
            return
        self.timer = loop.call_later(timeout, self._timed_out)

    def _connect_event(self, ev: int) -> None:
        """The connecting socket is writable (connected) or failed."""
        sock = self.connecting
        if sock is None:
            return
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not err and not ev & select.EPOLLOUT:
            return  # not yet
        client, loop = self.client, self.client.loop
        engine = client.engine
        assert loop is not None and engine is not None
        self.connecting = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if err:
            engine.forget(sock.fileno())
            sock.close()
            if not self.abandoned:
                self.abandoned = True
                client.dial_failed(self, OSError(err, os.strerror(err)))
            return
        leg = Leg(engine, loop, sock, (self.endpoint.host, self.endpoint.port), self, HIGH_WATER, LOW_WATER)
        engine.handlers[leg.fd] = leg.event
        self.connection_made(leg)  # type: ignore[arg-type]
        if ev & READABLE and not leg.closed:
            leg.event(ev & ~select.EPOLLOUT)  # what the endpoint sent with its SYN-ACK's edge

    def _timed_out(self) -> None:
        self.timer = None
        if not self.abandoned:
            self.abandon()
            self.client.dial_failed(self, TimeoutError())

    def abandon(self) -> None:
        """Give the dial up (its timeout, or the client left): its socket is closed, and a
        `connection_made` still to come (a loop's own transport) does not attach."""
        self.abandoned = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        sock, self.connecting = self.connecting, None
        if sock is not None and self.client.engine is not None:
            self.client.engine.forget(sock.fileno())
            sock.close()

    # -- endpoint events -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t: asyncio.Transport = transport  # type: ignore[assignment]  # (as ClientSide's)
        self.transport = t
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.abandoned:  # connected after its dial was given up: never attach
            t.close()
            return
        tune(t)
        self.attached = True  # before attach writes, so a pause_writing it causes is seen
        self.attached = self.client.attach(self)

    def data_received(self, data: bytes) -> None:
        if self.attached:
            self.client.reply(data)

    def eof_received(self) -> bool:
        if not self.attached:
            return False
        self.client.reply_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.attached:
            self.client.upstream_lost(self, exc)

    def pause_writing(self) -> None:
        if self.attached:
            self.client.pause_reading()

    def resume_writing(self) -> None:
        if self.attached:
            self.client.resume_reading()

    # -- what its ClientSide may ask -----------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Client → endpoint bytes."""
        if self.transport is not None:
            self.transport.write(data)

    def send_eof(self) -> None:
        """The client sent FIN: pass it on after the bytes before it."""
        if self.transport is not None:
            self.transport.write_eof()

    def close(self) -> None:
        """Close the endpoint connection after what is buffered, unless it is closing already."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def reset(self) -> None:
        """As `close`, but with RST: the client reset its connection."""
        if self.transport is not None and not self.transport.is_closing():
            reset(self.transport)

    def pause_reading(self) -> None:
        """The client leg is over its high-water mark: stop reading the endpoint."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def keepalive(self) -> None:
        """SO_KEEPALIVE on the endpoint leg, unless it is closing (the relay's sweep runs it)."""
        if self.transport is not None and not self.transport.is_closing():
            keepalive(self.transport)

    def over_high_water(self) -> bool:
        return self.transport is not None and self.transport.get_write_buffer_size() >= HIGH_WATER
