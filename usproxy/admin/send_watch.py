"""The send timeout of the admin and health-check servers: an answer that makes no progress into a
client that does not read is given up, and its connection closed.

Without it, a client that asks for a large answer (/services, /flows, /metrics at 5,000 Services)
and never reads it kept its request in flight forever: aiohttp has no write timeout, a connection
with a request in flight is never closed to make room (server.py), so each such client held one of
the listener's connections and the answer's buffered bytes until it left.

As nginx's send_timeout ("set only between two successive write operations"): a connection is
stalled while bytes wait in its userspace write buffer (the kernel's send buffer is full) and
neither that buffer nor the kernel's unacknowledged bytes (SIOCOUTQ) have changed for
SEND_TIMEOUT seconds. A client that reads changes them as its window opens (ACKs free the send
queue, the handler writes its next part), so one that stopped reading is closed, with RST (a cut
answer must not look complete). Checked every CHECK_PERIOD seconds: O(connections), at most 64
per listener.

Limit, as nginx's: the sender sees progress only when the client's window opens, and Linux
reopens a closed window only once the reader has freed a large part of its receive buffer. A
client reading steadily but slower than about that much per SEND_TIMEOUT looks stalled and is
cut too (measured on veth with default buffers: 10 KB/s shows progress every ~12 s, 3 KB/s
every ~41 s, 1 KB/s none in 45 s). Prometheus and curl read at once; the bound is what keeps a
client that never reads from holding a connection slot forever.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterable

from aiohttp import web

from usproxy.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
SEND_TIMEOUT = 60.0  # seconds without progress of a buffered answer (nginx's send_timeout default)
CHECK_PERIOD = 1.0  # seconds between checks


def unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes in the kernel's send queue of `transport`'s socket not yet acknowledged (SIOCOUTQ);
    0 when unknown. They move at every ACK, while the userspace buffer moves only when a third of
    the send buffer is free again (when the socket polls writable)."""
    sock = transport.get_extra_info("socket")
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return 0
    return int(struct.unpack("i", out)[0])


def reset(transport: asyncio.Transport) -> None:
    """Close at once with RST (SO_LINGER 0): the client sees its answer cut, not ended."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    transport.abort()


class SendWatch:
    """Aborts connections of `handlers()` whose buffered answer made no progress for `timeout`
    seconds (`check`, run by `start` every `period` seconds until `stop`); `where` names the
    servers in the log."""

    def __init__(self, handlers: Callable[[], Iterable[web.RequestHandler]], where: str, *,
                 timeout: float = SEND_TIMEOUT, period: float = CHECK_PERIOD) -> None:
        self.handlers = handlers
        self.where = where
        self.timeout = timeout
        self.period = period
        self.aborted = 0
        self._since: dict[int, tuple[int, float]] = {}  # id(transport) → (buffered bytes, unchanged since)
        self._task: asyncio.Task[None] | None = None

    def check(self, now: float | None = None) -> int:
        """Abort the stalled connections; returns how many (monotonic seconds `now`)."""
        now = time.monotonic() if now is None else now
        since: dict[int, tuple[int, float]] = {}
        aborted = 0
        for h in list(self.handlers()):
            t = h.transport
            if t is None or t.is_closing():
                continue
            buffered = t.get_write_buffer_size()
            if buffered == 0:
                continue
            size = buffered + unsent(t)
            seen = self._since.get(id(t))
            start = seen[1] if seen is not None and seen[0] == size else now
            if now - start >= self.timeout:
                reset(t)
                aborted += 1
                continue
            since[id(t)] = (size, start)
        self._since = since
        if aborted:
            self.aborted += aborted
            limited.warning("admin %s: closed %d connections whose answer waited %.0f s for the client "
                            "to read", self.where, aborted, self.timeout)
        return aborted

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.check()
