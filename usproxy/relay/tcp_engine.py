"""TcpEngine: the relay's TCP sockets on one epoll of its own, inside the event loop; Leg, a
relayed connection's socket as the subset of asyncio.Transport the relay's protocols use.

Why (issue 30 item 3): a connection relayed through the loop's own transports cost uvloop's
per-transport work on top of the relay's: a getsockname and a getpeername per leg (answers the
relay knows: the listener's address, accept's peer), the loop's transport registry (a Python
WeakValueDictionary), a context copy and a callback handle per event, and libuv's epoll bookkeeping
(an ADD that fails with EEXIST and is redone, a DEL after each EOF and again at close). A bare
uvloop relay with no bookkeeping at all spent 1.4x HAProxy's CPU per connection; on its own epoll,
1.15x. Here each socket is registered once, edge-triggered for reading and writing, and never
modified: close(2) takes it out of the epoll (no DEL) unless a dup of it lives on (`Leg.abort`,
used when a flow is handed to splice, unregisters first).

Invariants:
- The engine's epoll is one reader of the loop (`add_reader`), so everything runs in the loop's
  thread, on uvloop and asyncio alike; one engine per loop (`TcpEngine.of`), its epoll closed when
  the loop is collected.
- Each event goes to the handler registered for its descriptor now. A descriptor closed and
  reused by a new socket within one batch of events would receive the old socket's events: events
  of descriptors registered during the batch are skipped (theirs come with the next poll).
- Edge-triggered reading: a Leg reads until a read comes back short (or READS_PER_EVENT full
  reads, then once more in the loop's next turn), so nothing queued is left without a later event;
  once an event said the peer's FIN (or an error) came, it reads on to the end of the stream, as
  that edge may have come with the last bytes. `resume_reading` reads in the loop's next turn,
  since no new edge comes for what waited.
- Leg's transport semantics are asyncio's: writes that the socket does not take at once are
  buffered and sent when it is writable, pause_writing above the high-water mark and
  resume_writing at or below the low-water mark; write_eof sends FIN after the buffered bytes,
  close closes after them (SO_LINGER 0 set by the caller makes that close a reset), abort drops
  them; eof_received returning false closes. One difference: connection_lost runs once, at once
  (not in the loop's next turn: two callback handles per connection less), right after the socket
  is closed, and the Leg lets its protocol go first. So a protocol may hear connection_lost inside
  a call it made (close, abort, write); every Leg method checks its state after calling out, and
  tcp.py's protocols keep their own (`closed`, `lost`, `attached`) for the same reason.
- Accepted sockets stay in blocking mode (accept(2) does not make them non-blocking, and one
  ioctl per connection less): every read and write passes MSG_DONTWAIT. Dialed sockets are made
  non-blocking (SOCK_NONBLOCK) for connect(2).
"""

from __future__ import annotations

import _socket
import asyncio
import errno
import logging
import os
import select
import socket
import weakref
from collections.abc import Callable
from typing import Any

from usproxy.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

HIGH_WATER = 64 * 1024  # a Leg's write-buffer limits by default (the relay's, tcp.py)
LOW_WATER = 16 * 1024
READ_SIZE = 256 * 1024  # as both loops' transports: the relay's per-leg bound counts one such read
READS_PER_EVENT = 4  # full reads per event before the rest waits for the loop's next turn
MAX_EVENTS = 256  # per poll of the engine's epoll (an array of that many is made per poll; more wait a turn)
EDGE = select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET
READABLE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
HANGUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
DONTWAIT = socket.MSG_DONTWAIT

Handler = Callable[[int], None]
_ENGINES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TcpEngine] = weakref.WeakKeyDictionary()


class TcpEngine:
    """One epoll for every relayed TCP socket and listener of a loop."""

    __slots__ = ("ep", "handlers", "buf", "fresh", "dispatching", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ep = select.epoll()
        self.handlers: dict[int, Handler] = {}
        self.buf = bytearray(READ_SIZE)  # every read lands here first: one copy, of what was read
        self.fresh: set[int] = set()  # descriptors registered while a batch is dispatched
        self.dispatching = False
        loop.add_reader(self.ep.fileno(), self._events)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> TcpEngine:
        """The loop's engine, made on first use."""
        engine = _ENGINES.get(loop)
        if engine is None:
            engine = _ENGINES[loop] = cls(loop)
            weakref.finalize(loop, engine.ep.close)
        return engine

    def register(self, fd: int, events: int, handler: Handler) -> None:
        self.handlers[fd] = handler
        self.ep.register(fd, events)
        if self.dispatching:
            self.fresh.add(fd)

    def unregister(self, fd: int) -> None:
        """Out of the epoll now (for a descriptor that is not closed, or whose file lives on in a
        dup); a closed descriptor needs only `forget`."""
        self.handlers.pop(fd, None)
        try:
            self.ep.unregister(fd)
        except OSError:
            pass

    def forget(self, fd: int) -> None:
        """No handler for `fd` any more: its socket is about to be closed (close(2) takes it out of
        the epoll)."""
        self.handlers.pop(fd, None)

    def connect(self, host: str, port: int, handler: Handler) -> _socket.socket:
        """A non-blocking socket connecting to host:port (an address literal), registered with
        `handler`, which hears when it is writable (connected) or failed. Raises OSError when the
        socket cannot be made or the connect fails at once."""
        sock = _socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                              socket.SOCK_STREAM | socket.SOCK_NONBLOCK)  # (the C type: no Python __init__)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rc = sock.connect_ex((host, port))
            if rc and rc != errno.EINPROGRESS:
                raise OSError(rc, os.strerror(rc))
            self.register(sock.fileno(), EDGE, handler)
        except BaseException:
            sock.close()
            raise
        return sock

    def _events(self) -> None:
        try:
            events = self.ep.poll(0, MAX_EVENTS)
        except InterruptedError:
            return
        handlers, fresh = self.handlers, self.fresh
        self.dispatching = True
        try:
            for fd, ev in events:
                if fresh and fd in fresh:
                    continue  # a new socket on a descriptor number closed in this batch
                handler = handlers.get(fd)
                if handler is not None:
                    try:
                        handler(ev)
                    except Exception as err:  # one socket's fault never stops the others'
                        limited.warning("relayed TCP socket: handler failed: %r", err)
                        log.debug("handler of descriptor %d failed", fd, exc_info=True)
        finally:
            self.dispatching = False
            if fresh:
                fresh.clear()


class Leg:
    """One socket of a relayed TCP connection, as the asyncio.Transport its protocol expects
    (the methods the relay uses; see the module docstring for the semantics)."""

    __slots__ = ("engine", "loop", "sock", "fd", "protocol", "peer", "local", "buffer", "high", "low",
                 "reading", "hup", "paused", "eof_pending", "closing", "closed")

    def __init__(self, engine: TcpEngine, loop: asyncio.AbstractEventLoop, sock: _socket.socket,
                 peer: Any, protocol: asyncio.Protocol, high: int, low: int) -> None:
        self.engine = engine
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self.protocol: asyncio.Protocol | None = protocol
        self.peer = peer
        self.local: Any = None  # getsockname, on request only
        self.buffer = bytearray()
        self.high, self.low = high, low
        self.reading = True
        self.hup = False  # the peer's FIN (or an error) came: read on to the end, whatever the edges
        self.paused = False  # the protocol was told pause_writing
        self.eof_pending = False  # write_eof: FIN once the buffer is sent
        self.closing = False
        self.closed = False

    # -- events ----------------------------------------------------------------------------------
    def event(self, ev: int) -> None:
        if ev & HANGUP:
            self.hup = True  # its edge may come with data: a short read would not be the end
        if ev & select.EPOLLOUT and self.buffer:
            self._flush()
        if self.reading:
            if ev & READABLE:
                self._read()
        elif ev & select.EPOLLERR and not self.closed:
            self._error()

    def _read(self) -> None:
        buf, sock = self.engine.buf, self.sock
        for _ in range(READS_PER_EVENT):
            try:
                n = sock.recv_into(buf, READ_SIZE, DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fatal(exc)
                return
            if not n:
                self._eof()
                return
            self.protocol.data_received(buf[:n])  # type: ignore[union-attr,arg-type]  # (bytes-like)
            if not self.reading:
                return
            if n < READ_SIZE and not self.hup:
                return  # all that was queued (what comes later brings its own edge)
        self.loop.call_soon(self._read_later)  # more may wait, and no new edge comes for it

    def _read_later(self) -> None:
        if self.reading and not self.closed:
            self._read()

    def _eof(self) -> None:
        self.reading = False
        if not self.protocol.eof_received():  # type: ignore[union-attr]
            self.close()

    def _error(self) -> None:
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._fatal(OSError(err, os.strerror(err)))

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.buffer, DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fatal(exc)
            return
        del self.buffer[:n]
        self._sent()

    def _sent(self) -> None:
        """After a send from the buffer: resume the protocol, and FIN or close once it is empty."""
        if self.paused and len(self.buffer) <= self.low:
            self.paused = False
            self.protocol.resume_writing()  # type: ignore[union-attr]
        if not self.buffer and not self.closed:
            if self.closing:
                self._close_now(None)
            elif self.eof_pending:
                self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer reset it: reading says so

    def _fatal(self, exc: Exception) -> None:
        if not self.closed:
            self.buffer.clear()
            self._close_now(exc)

    def _close_now(self, exc: Exception | None) -> None:
        self.closed = self.closing = True
        self.reading = False
        self.engine.forget(self.fd)
        self.sock.close()
        protocol, self.protocol = self.protocol, None  # no cycle left with the protocol
        if protocol is not None:
            protocol.connection_lost(exc)

    # -- asyncio.Transport ---------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof_pending:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self.closing or not data:
            return
        if not self.buffer:
            try:
                n = self.sock.send(data, DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._fatal(exc)
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
        self.buffer += data
        if len(self.buffer) > self.high and not self.paused:
            self.paused = True
            self.protocol.pause_writing()  # type: ignore[union-attr]

    def write_eof(self) -> None:
        if self.closing or self.eof_pending:
            return
        self.eof_pending = True
        if not self.buffer:
            self._shutdown()

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.reading = False
        if not self.buffer:
            self._close_now(None)

    def abort(self) -> None:
        """Close now, dropping what is buffered. The socket leaves the epoll first: its file may
        live on in a dup (a flow handed to splice)."""
        if self.closed:
            return
        self.buffer.clear()
        self.engine.unregister(self.fd)
        self._close_now(None)

    def is_closing(self) -> bool:
        return self.closing

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if self.closing or self.reading:
            return
        self.reading = True
        self.loop.call_soon(self._read_later)

    def get_write_buffer_size(self) -> int:
        return len(self.buffer)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.low, self.high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self.high, self.low = high, low
        if len(self.buffer) > high and not self.paused and not self.closing:
            self.paused = True
            self.protocol.pause_writing()  # type: ignore[union-attr]

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self.sock if not self.closed else default
        if name == "peername":
            return self.peer
        if name == "sockname":
            if self.local is None and not self.closed:
                try:
                    self.local = self.sock.getsockname()
                except OSError:
                    return default
            return self.local if self.local is not None else default
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol | None:
        return self.protocol
