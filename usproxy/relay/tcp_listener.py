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
collection (asyncio/selector_events.py, CPython 3.11). So on asyncio this class accepts itself and
hands each socket to `loop.connect_accepted_socket`, which involves no Server; a socket whose hand-
over fails is reset. uvloop accepts and makes the transport inside one libuv callback
(uvloop/handles/streamserver.pyx `_on_listen`), so nothing can close its server in between; its
Server is kept there, which costs one task per connection less.

The socket is made here on both loops: SO_REUSEADDR (a restarted agent rebinds at once),
SO_KEEPALIVE (inherited by every accepted connection on Linux), IPV6_V6ONLY for IPv6,
IP_FREEBIND (the relay binds a new frontend before its address is on the ClusterIP interface,
so a capture of its port, port_capture.py, is in place before the first packet can arrive),
backlog BACKLOG. A failed bind raises OSError with the kernel's strerror. Port 0 binds a port the
kernel picks (`port`), where a captured frontend's traffic is sent.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Callable

from usproxy.util.ratelimit import RateLimitedLog
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


def accepts_atomically(loop: asyncio.AbstractEventLoop) -> bool:
    """True where the loop's Server makes the transport in the callback that accepts (uvloop)."""
    return type(loop).__module__.split(".")[0] == "uvloop"


class TcpListener:
    """A frontend's listening socket; `factory()` makes the protocol of each connection."""

    __slots__ = ("sock", "factory", "loop", "server", "handing", "retry", "closed")

    def __init__(self, sock: socket.socket, factory: ProtocolFactory) -> None:
        self.sock = sock
        self.factory = factory
        self.loop = asyncio.get_running_loop()
        self.server: asyncio.AbstractServer | None = None
        self.handing: set[asyncio.Task[object]] = set()  # accepted sockets on their way to a protocol
        self.retry: asyncio.TimerHandle | None = None
        self.closed = False

    @classmethod
    async def open(cls, addr: str, port: int, factory: ProtocolFactory) -> TcpListener:
        """Listen on addr:port; raises OSError when the address cannot be bound."""
        listener = cls(listening_socket(addr, port), factory)
        if not accepts_atomically(listener.loop):
            listener.loop.add_reader(listener.sock.fileno(), listener._accept)
            return listener
        try:
            listener.server = await listener.loop.create_server(factory, sock=listener.sock, backlog=BACKLOG)
        except BaseException:
            listener.sock.close()
            raise
        return listener

    @property
    def port(self) -> int:
        """The port the socket is bound to (the kernel's pick when opened with port 0)."""
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        """Stop listening: the kernel resets the connections still in the accept queue, and the
        ones already accepted reach their protocol all the same. Established ones run on."""
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()  # closes the socket (uvloop detaches ours first)
            return
        if self.retry is not None:
            self.retry.cancel()
        else:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(BACKLOG):  # everything queued, as asyncio's own accept loop does
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:
                self._accept_failed(err)
                return
            conn.setblocking(False)
            self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        task = self.loop.create_task(self.loop.connect_accepted_socket(self.factory, conn))
        self.handing.add(task)
        task.add_done_callback(functools.partial(self._handed, conn))

    def _handed(self, conn: socket.socket, task: asyncio.Task[object]) -> None:
        self.handing.discard(task)
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                limited.warning("accepted connection not relayed: %s", task.exception())
            reset_socket(conn)  # no transport took it: refuse, never leave it open

    def _accept_failed(self, err: OSError) -> None:
        """accept() failed. Out of descriptors (or memory), the socket would be reported
        readable again at once: stop watching it for ACCEPT_RETRY seconds (as asyncio does).
        Other errors are the accepted connection's own (accept(2)): the next event goes on."""
        limited.warning("accept on %s: %s", self.sock.getsockname(), err)
        if err.errno in OUT_OF_RESOURCES:
            self.loop.remove_reader(self.sock.fileno())
            self.retry = self.loop.call_later(ACCEPT_RETRY, self._watch)

    def _watch(self) -> None:
        self.retry = None
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)
