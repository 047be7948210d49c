"""TcpListener: one listening TCP socket on a frontend, which strands no client when it closes.

Invariant: every connection the kernel completed on this socket is either handed to a protocol
(a ClientSide, which relays it or resets it when its ServicePort has no usable endpoint) or reset
by the kernel when the socket closes (Linux resets what still sits in the accept queue of a closed
listener); none is ever accepted and then left open with nobody reading it. That fault is
kube-proxy 1.0's accept-then-hang: a client that connected in the moment its Service lost its
last endpoint waited for its timeout (C01).

asyncio's own Server has exactly this fault: it accepts in the listener's reader callback and makes
the transport in a task that runs later; when the Server was closed in between (a sync closing the
listener in the same loop iteration), making the transport fails (`Server._attach` asserts, and
`_accept_connection2` swallows the error) and the accepted socket stays open until garbage
collection (asyncio/selector_events.py, CPython 3.11). So no loop's Server is used: on both loops
the listening socket is one of the relay's TcpEngine (tcp_engine.py), and each accepted socket
becomes a Leg handed to its protocol in the same callback that accepted it (no task, no transport
of the loop), so nothing can close the listener in between. accept(2) gives the client's address
(no getpeername); the accepted socket inherits SO_KEEPALIVE and TCP_NODELAY from the listener
(Linux), so nothing is set per connection.

The socket is made here: SO_REUSEADDR (a restarted agent rebinds at once), SO_KEEPALIVE and
TCP_NODELAY (inherited by every accepted connection), IPV6_V6ONLY for IPv6, IP_FREEBIND (the relay
binds a new frontend before its address is on the ClusterIP interface, so a capture of its port,
port_capture.py, is in place before the first packet can arrive), backlog BACKLOG. A failed bind
raises OSError with the kernel's strerror. Port 0 binds a port the kernel picks (`port`), where a
captured frontend's traffic is sent.
"""

from __future__ import annotations

import _socket
import asyncio
import errno
import logging
import select
import socket
from collections.abc import Callable

from usproxy.util.ratelimit import RateLimitedLog
from usproxy.relay.tcp_engine import EDGE, HIGH_WATER, LOW_WATER, Leg, TcpEngine
from usproxy.relay.tcp_splice import reset_socket

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

BACKLOG = 4096
IP_FREEBIND, IPV6_FREEBIND = 15, 78  # linux/in.h, linux/in6.h
ACCEPT_RETRY = 1.0  # seconds without accepting after the process ran out of descriptors (as asyncio)
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

ProtocolFactory = Callable[[], asyncio.Protocol]


def listening_socket(addr: str, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on addr:port (an IPv4 or IPv6 literal)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        freebind(sock)
        sock.setblocking(False)
        sock.bind((addr, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def freebind(sock: socket.socket) -> None:
    """Allow binding an address that is not (yet) local: IP_FREEBIND, IPV6_FREEBIND for IPv6."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)


class TcpListener:
    """A frontend's listening socket; `factory()` makes the protocol of each connection."""

    __slots__ = ("sock", "fd", "family", "factory", "loop", "engine", "retry", "closed")

    def __init__(self, sock: socket.socket, factory: ProtocolFactory) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.family = int(sock.family)  # (socket.family makes an enum on every read)
        self.factory = factory
        self.loop = asyncio.get_running_loop()
        self.engine = TcpEngine.of(self.loop)
        self.retry: asyncio.TimerHandle | None = None
        self.closed = False

    @classmethod
    async def open(cls, addr: str, port: int, factory: ProtocolFactory) -> TcpListener:
        """Listen on addr:port; raises OSError when the address cannot be bound."""
        listener = cls(listening_socket(addr, port), factory)
        listener._watch()
        return listener

    @property
    def port(self) -> int:
        """The port the socket is bound to (the kernel's pick when opened with port 0)."""
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        """Stop listening: the kernel resets the connections still in the accept queue, and the
        ones already accepted reached their protocol. Established ones run on."""
        if self.closed:
            return
        self.closed = True
        if self.retry is not None:
            self.retry.cancel()
        self.engine.forget(self.fd)
        self.sock.close()

    def _accept(self, _: int) -> None:
        family, engine, loop = self.family, self.engine, self.loop
        for _ in range(BACKLOG):  # everything queued, as asyncio's own accept loop does
            try:
                fd, peer = self.sock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:
                self._accept_failed(err)
                return
            conn = _socket.socket(family, socket.SOCK_STREAM, 0, fd)  # (the C type: no Python __init__)
            try:
                protocol = self.factory()
                leg = Leg(engine, loop, conn, peer, protocol, HIGH_WATER, LOW_WATER)
                engine.register(fd, EDGE, leg.event)
            except Exception as err:  # no protocol took it: refuse, never leave it open
                limited.warning("accepted connection not relayed: %s", err)
                engine.forget(fd)
                reset_socket(conn)
                continue
            protocol.connection_made(leg)  # type: ignore[arg-type]

    def _accept_failed(self, err: OSError) -> None:
        """accept() failed. Out of descriptors (or memory), the socket would be reported
        readable again at once: stop watching it for ACCEPT_RETRY seconds (as asyncio does).
        Other errors are the accepted connection's own (accept(2)): the next event goes on."""
        limited.warning("accept on %s: %s", self.sock.getsockname(), err)
        if err.errno in OUT_OF_RESOURCES:
            self.engine.unregister(self.fd)
            self.retry = self.loop.call_later(ACCEPT_RETRY, self._watch)

    def _watch(self) -> None:
        self.retry = None
        if not self.closed:
            self.engine.register(self.fd, select.EPOLLIN, self._accept)
