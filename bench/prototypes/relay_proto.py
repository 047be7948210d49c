"""Relay prototypes: what the usproxy TCP relay's hot path could be, measured in the bench harness.

Two modes on uvloop, one fixed backend, no flow table or metrics (so the difference to the real
relay also shows what its bookkeeping costs):
- `protocol`: asyncio Protocols, one per side, write() into the peer's transport, pause/resume on
  the peer's high-water mark: the shape of usproxy/relay/tcp.py, minus the bookkeeping.
- `splice`: raw non-blocking sockets on the loop's add_reader/add_writer; each direction moves
  bytes socket → pipe → socket with os.splice (zero-copy: the payload never enters Python). A
  direction stops reading while its pipe cannot drain into the peer (backpressure = the pipe
  plus the socket buffers), forwards EOF as shutdown(SHUT_WR) after the pipe drained, and a
  reset tears both sides down. The endpoint connection exists before the first read, so nothing
  arrives early: the kernel holds the client's bytes meanwhile.
`--workers N` forks N processes that each bind the ports with SO_REUSEPORT (both cores accept).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import functools
import os
import signal
import socket
from typing import cast

import uvloop

PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
HIGH_WATER, LOW_WATER = 1 << 20, 256 << 10


# -- protocol mode ---------------------------------------------------------------------------------
class Client(asyncio.Protocol):
    def __init__(self, backend: tuple[str, int]) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.up: Upstream | None = None
        self.pending = bytearray()
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _tune(self.transport)
        asyncio.get_running_loop().create_task(self._dial())

    async def _dial(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: Upstream(self), *self.backend)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.up = up
        assert up.transport is not None
        if self.transport is None or self.transport.is_closing():
            up.transport.close()
            return
        if self.pending:
            up.transport.write(bytes(self.pending))
            self.pending.clear()
        self.transport.resume_reading()
        if self.eof:
            up.transport.write_eof()

    def data_received(self, data: bytes) -> None:
        up = self.up
        if up is not None and up.transport is not None:
            up.transport.write(data)
            return
        self.pending += data  # before the endpoint connection exists: buffer, bounded
        if len(self.pending) >= HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if self.up is not None and self.up.transport is not None:
            self.up.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()

    def pause_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.resume_reading()


class Upstream(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _tune(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.client.transport is not None:
            self.client.transport.write(data)

    def eof_received(self) -> bool:
        if self.client.transport is not None and not self.client.transport.is_closing():
            self.client.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()

    def pause_writing(self) -> None:
        if self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client.transport is not None:
            self.client.transport.resume_reading()


def _tune(t: asyncio.Transport) -> None:
    sock = t.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)


# -- splice mode -----------------------------------------------------------------------------------
class Pump:
    """One direction of a spliced connection: src socket → pipe → dst socket."""

    __slots__ = ("loop", "src", "dst", "dst_sock", "r", "w", "queued", "eof", "done", "pair", "reading")

    def __init__(self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket, pair: SplicePair) -> None:
        self.loop, self.src, self.dst, self.dst_sock, self.pair = loop, src.fileno(), dst.fileno(), dst, pair
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.w, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass
        self.queued = 0  # bytes in the pipe
        self.eof = self.done = self.reading = False

    def start(self) -> None:
        self.reading = True
        self.loop.add_reader(self.src, self.readable)

    def readable(self) -> None:
        try:
            n = os.splice(self.src, self.w, PIPE_SIZE - self.queued, flags=SPLICE_FLAGS)
        except BlockingIOError:
            return
        except OSError:
            self.pair.abort()
            return
        if n == 0:
            self.eof = True
            self._stop_reading()
        self.queued += n
        self.drain()

    def drain(self) -> None:
        while self.queued:
            try:
                self.queued -= os.splice(self.r, self.dst, self.queued, flags=SPLICE_FLAGS)
            except BlockingIOError:
                self._stop_reading()
                self.loop.add_writer(self.dst, self.writable)
                return
            except OSError:
                self.pair.abort()
                return
        if self.eof:
            self._finish()
        elif not self.reading:
            self.start()

    def writable(self) -> None:
        self.loop.remove_writer(self.dst)
        self.drain()

    def _stop_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.src)

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            try:
                self.dst_sock.shutdown(socket.SHUT_WR)  # FIN after the last byte
            except OSError:
                pass
            self.pair.finished()

    def close(self) -> None:
        self._stop_reading()
        self.loop.remove_writer(self.dst)
        os.close(self.r)
        os.close(self.w)


class SplicePair:
    """Both directions of one relayed connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: socket.socket, up: socket.socket) -> None:
        self.client, self.up = client, up
        self.pumps = (Pump(loop, client, up, self), Pump(loop, up, client, self))
        self.closed = False

    def start(self) -> None:
        for p in self.pumps:
            p.start()

    def finished(self) -> None:
        if all(p.done for p in self.pumps):
            self.close()

    def abort(self) -> None:
        for s in (self.client, self.up):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self.pumps:
            p.close()
        self.client.close()
        self.up.close()


class SpliceListener:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, backend: tuple[str, int]) -> None:
        self.loop, self.sock, self.backend = loop, sock, backend
        loop.add_reader(sock.fileno(), self.accept)

    def accept(self) -> None:
        for _ in range(64):
            try:
                c, _ = self.sock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    return
                raise
            c.setblocking(False)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            up.setblocking(False)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rc = up.connect_ex(self.backend)
            if rc not in (0, errno.EINPROGRESS):
                c.close()
                up.close()
                continue
            self.loop.add_writer(up.fileno(), self.connected, c, up)

    def connected(self, c: socket.socket, up: socket.socket) -> None:
        self.loop.remove_writer(up.fileno())
        if up.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            c.close()
            up.close()
            return
        SplicePair(self.loop, c, up).start()


# -- main ------------------------------------------------------------------------------------------
def listener(addr: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((addr, port))
    s.listen(4096)
    s.setblocking(False)
    return s


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    ports = [int(p) for p in args.ports.split(",")]
    keep: list[object] = []
    for port in ports:
        sock = listener(args.listen, port)
        if args.mode == "splice":
            keep.append(SpliceListener(loop, sock, (args.backend, port)))
        else:
            keep.append(await loop.create_server(functools.partial(Client, (args.backend, port)), sock=sock))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--ports", required=True)
    ap.add_argument("--mode", choices=["protocol", "splice"], default="splice")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    children = []
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            uvloop.run(serve(args))
            os._exit(0)
        children.append(pid)
    try:
        uvloop.run(serve(args))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
