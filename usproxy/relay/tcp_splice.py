"""SplicedFlow: a relayed TCP connection whose bytes move socket → pipe → socket by splice(2).

A connection that turns out to be bulk (tcp.py's ClientSide decides, and hands its two sockets
over with nothing left in userspace) is pumped here: each direction has its own pipe, and the
payload never enters Python (issue 17: the relay's CPU per GiB was 86 % `read` and `write`; the
splice prototype in bench/prototypes halved it). Runs on uvloop and asyncio alike: only
`add_reader`/`add_writer` on descriptors no transport owns. Invariants:
- Backpressure: a direction reads its source only while its pipe is empty, and stops while the
  pipe cannot drain into the destination (which it then waits to be writable for). So at most one
  pipe's capacity (PIPE_SIZE) per direction is held beyond the two sockets' kernel buffers.
- Half-close per direction: EOF from a source becomes shutdown(SHUT_WR) on the destination once
  its pipe drained (the FIN after the last byte, C09/C11). The second EOF closes both sockets
  instead: the close sends the same FIN after the same bytes (as tcp.py).
- A reset or error on one socket ends the flow: what the pipe toward the other socket holds is
  written if the kernel takes it at once, then the other socket is reset (SO_LINGER 0), as tcp.py
  passes a reset on after the bytes received before it.
- Flow accounting: each splice from a socket is one "packet" of its byte count (Flow.seen_in for
  the client's bytes, Flow.seen_out for the endpoint's); the state goes FIN_WAIT at the first EOF,
  CLOSING at the second.
- Descriptors: the two pipes (four descriptors) are the caller's to budget; `finished` runs exactly
  once, after every descriptor of the flow is closed.
"""

from __future__ import annotations

import _socket
import asyncio
import fcntl
import os
import socket
import struct
from collections.abc import Callable

from usproxy.flows.flow_table import Flow

PIPE_SIZE = 256 * 1024  # per direction: the relay's bound per leg (HIGH_WATER plus one read), in the kernel
READS_PER_WAKEUP = 8
PIPE_FDS = 4  # two pipes, two descriptors each
F_SETPIPE_SZ = 1031  # fcntl.h (Linux); Python's fcntl has it only from 3.10 on some builds
F_GETPIPE_SZ = 1032
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK if hasattr(os, "splice") else 0
LINGER_ZERO = struct.pack("ii", 1, 0)  # SO_LINGER on with 0 s: close() sends RST


def available() -> bool:
    """Whether this Python and kernel offer splice(2) (Linux, Python 3.10+)."""
    return hasattr(os, "splice")


def pipe() -> tuple[int, int, int]:
    """A non-blocking pipe of PIPE_SIZE (or what the kernel grants): (read fd, write fd, capacity
    in bytes). Raises OSError (EMFILE, ENFILE) when there is no descriptor for it."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # over pipe-max-size or the user's pipe pages: keep the default
    try:
        size = min(PIPE_SIZE, fcntl.fcntl(w, F_GETPIPE_SZ))
    except OSError:
        size = 65536
    return r, w, size


def reset_socket(sock: _socket.socket) -> None:
    """Close a socket no transport owns with RST (SO_LINGER 0); a closed one is left alone."""
    if sock.fileno() != -1:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_ZERO)
        except OSError:
            pass
        sock.close()


class Pump:
    """One direction: `src` socket → pipe → `dst` socket. `count(n)` is told every n bytes read."""

    __slots__ = ("flow", "src", "dst", "sfd", "dfd", "r", "w", "size", "count", "queued", "reading",
                 "writing", "eof", "done")

    def __init__(self, flow: SplicedFlow, src: socket.socket, dst: socket.socket,
                 pipe_fds: tuple[int, int, int], count: Callable[[int], None]) -> None:
        self.flow = flow
        self.src, self.dst = src, dst
        self.sfd, self.dfd = src.fileno(), dst.fileno()
        self.r, self.w, self.size = pipe_fds
        self.count = count
        self.queued = 0  # bytes in the pipe
        self.reading = self.writing = self.eof = self.done = False

    def start(self) -> None:
        if not self.reading:
            self.reading = True
            self.flow.loop.add_reader(self.sfd, self.readable)

    def readable(self) -> None:
        """The source has bytes (or EOF, or an error): move them into the (empty) pipe and on,
        again while a read fills the pipe and the destination takes it all (up to
        READS_PER_WAKEUP times: one event-loop turn per pipeful would cost more than the copy
        splice saves)."""
        for _ in range(READS_PER_WAKEUP):
            try:
                n = os.splice(self.sfd, self.w, self.size, flags=SPLICE_FLAGS)
            except BlockingIOError:
                return
            except OSError:
                self.flow.lost(self.src)
                return
            if n == 0:
                self.eof = True
                self.stop_reading()
            else:
                self.count(n)
                self.queued += n
            if not self.drain() or n < self.size:
                return

    def drain(self) -> bool:
        """Pipe → destination until empty; if the destination is full, stop reading until it is
        writable again. Empty at EOF: the direction is finished. True when the pipe is empty and
        the source may be read again."""
        while self.queued:
            try:
                n = os.splice(self.r, self.dfd, self.queued, flags=SPLICE_FLAGS)
            except BlockingIOError:
                n = 0
            except OSError:
                self.flow.lost(self.dst)
                return False
            if n == 0:
                self.stop_reading()
                if not self.writing:
                    self.writing = True
                    self.flow.loop.add_writer(self.dfd, self.drain)
                return False
            self.queued -= n
        if self.writing:
            self.writing = False
            self.flow.loop.remove_writer(self.dfd)
        if self.eof:
            self.flow.finished_one(self)
            return False
        self.start()
        return True

    def flush(self) -> None:
        """What the pipe holds, into the destination as far as the kernel takes it at once."""
        while self.queued:
            try:
                n = os.splice(self.r, self.dfd, self.queued, flags=SPLICE_FLAGS)
            except OSError:
                return
            if n == 0:
                return
            self.queued -= n

    def stop_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.flow.loop.remove_reader(self.sfd)

    def close(self) -> None:
        """Unregister and close the pipe (the sockets are the flow's)."""
        self.stop_reading()
        if self.writing:
            self.writing = False
            self.flow.loop.remove_writer(self.dfd)
        os.close(self.r)
        os.close(self.w)


class SplicedFlow:
    """Both directions of one relayed connection, on sockets taken from their transports.

    `pipes` are two results of `pipe()` (client → endpoint first), owned from here on;
    `finished()` runs once when the flow is over (both sockets and pipes closed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: socket.socket, endpoint: socket.socket,
                 flow: Flow | None, pipes: tuple[tuple[int, int, int], tuple[int, int, int]],
                 finished: Callable[[], None]) -> None:
        self.loop = loop
        self.client, self.endpoint = client, endpoint
        self.flow = flow
        self.finished = finished
        seen_in = flow.seen_in if flow is not None else _ignore
        seen_out = flow.seen_out if flow is not None else _ignore
        self.pumps = (Pump(self, client, endpoint, pipes[0], seen_in),
                      Pump(self, endpoint, client, pipes[1], seen_out))
        self.closed = False

    @property
    def sockets(self) -> tuple[socket.socket, socket.socket]:
        return self.client, self.endpoint

    def start(self) -> None:
        for p in self.pumps:
            p.start()

    def finished_one(self, pump: Pump) -> None:
        """`pump`'s source sent EOF and its pipe drained: pass the FIN on, or close both when the
        other direction is done too (the close sends that FIN)."""
        if pump.done:
            return
        pump.done = True
        if all(p.done for p in self.pumps):
            if self.flow is not None:
                self.flow.state = "CLOSING"
            self.close()
            return
        if self.flow is not None:
            self.flow.state = "FIN_WAIT"
        try:
            pump.dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.lost(pump.dst)

    def lost(self, dead: socket.socket) -> None:
        """`dead` failed (reset, or an error): hand the other socket what the pipe toward it
        holds, as far as it takes it now, then reset it."""
        if self.closed:
            return
        survivor = self.endpoint if dead is self.client else self.client
        for p in self.pumps:
            if p.dst is survivor:
                p.flush()
        self.close(reset=survivor)

    def expire(self) -> None:
        """Idle past its timeout: reset both sockets (the relay's sweep, Flow.closer)."""
        self.close(reset=None, both=True)

    def keepalive(self) -> None:
        """SO_KEEPALIVE on the endpoint socket (Flow.settle, as tcp.py's keepalive)."""
        if not self.closed:
            try:
                self.endpoint.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            except OSError:
                pass

    def close(self, reset: socket.socket | None = None, both: bool = False) -> None:
        """Unregister, close the pipes, close both sockets (`reset` or `both` with RST); once."""
        if self.closed:
            return
        self.closed = True
        for p in self.pumps:
            p.close()
        for s in self.sockets:
            if both or s is reset:
                reset_socket(s)
            else:
                s.close()
        self.finished()


def _ignore(n: int) -> None:
    pass
