"""The bench server: one epoll loop in a pod netns serving every data-plane test on fixed ports.

Ports (the same for every contender; contenders forward them unchanged):
- BULK: the client sends a 16-byte header (`!QQ`: length, flags) then `length` bytes; the server
  answers `!Q` (bytes received) and a 20-byte SHA-1 of the payload (zeros unless flags & 1).
- RR: 1 KiB requests, each answered by 1 KiB, on keep-alive connections.
- CONN: one 64-byte request, one 64-byte answer carrying the server's name, then the server
  closes first (so TIME_WAIT stays on the server side and the client's ports are not held).
- UDP: echo, datagram for datagram.
- HOLD: accepts and keeps connections open without traffic (idle flows for the memory test).
- HTTP, IPERF (TCP and UDP), IPERF_ROUTED, REDIS: not served here; bench/tools.py runs nginx, `iperf3 -s` and
  redis-server on them in the same pod netns for the real tools' runs.

Run as `python -m bench.servers NAME [--workers N]`; prints "ready" when listening. Workers share
the ports with SO_REUSEPORT. Kept lean: the server must not be what limits a contender.
"""

from __future__ import annotations

import hashlib
import os
import resource
import select
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field

BULK, RR, CONN, UDP, HOLD = 5001, 5002, 5003, 5004, 5005
HTTP, IPERF, REDIS = 8080, 5201, 6379  # the real tools' servers (bench/tools.py)
IPERF_ROUTED = 5211  # a second `iperf3 -s`, bound to the routed address (bench/topology.py ROUTED_IP)
RR_SIZE = 1024
CONN_SIZE = 64
BULK_HEADER = struct.Struct("!QQ")
BULK_CHECKSUM = 1
RECV_BUF = 1 << 20


@dataclass(slots=True, eq=False)
class Conn:
    sock: socket.socket
    port: int
    got: int = 0
    remaining: int = -1  # bulk: payload bytes still expected (-1: header not read yet)
    header: bytes = b""
    hasher: "hashlib._Hash | None" = None
    out: bytes = b""
    closing: bool = field(default=False)


class Server:
    """All listeners and connections of one worker."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()[:CONN_SIZE]
        self.conn_reply = self.name.ljust(CONN_SIZE, b".")
        self.rr_reply = b"r" * RR_SIZE
        self.ep = select.epoll()
        self.buf = bytearray(RECV_BUF)
        self.view = memoryview(self.buf)
        self.listeners: dict[int, tuple[socket.socket, int]] = {}
        self.conns: dict[int, Conn] = {}
        self.udp: socket.socket | None = None

    def listen(self) -> None:
        for port in (BULK, RR, CONN, HOLD):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("0.0.0.0", port))
            s.listen(4096)
            s.setblocking(False)
            self.listeners[s.fileno()] = (s, port)
            self.ep.register(s.fileno(), select.EPOLLIN)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        u.bind(("0.0.0.0", UDP))
        u.setblocking(False)
        self.udp = u
        self.ep.register(u.fileno(), select.EPOLLIN)

    def serve(self) -> None:
        while True:
            for fd, ev in self.ep.poll(1.0):
                if fd in self.listeners:
                    self._accept(*self.listeners[fd])
                elif self.udp is not None and fd == self.udp.fileno():
                    self._udp(self.udp)
                else:
                    c = self.conns.get(fd)
                    if c is None:
                        continue
                    if ev & select.EPOLLOUT:
                        self._flush(c)
                    if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        self._read(c)

    def _accept(self, lsock: socket.socket, port: int) -> None:
        for _ in range(64):
            try:
                s, _ = lsock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return
            except OSError:
                return
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[s.fileno()] = Conn(s, port)
            self.ep.register(s.fileno(), select.EPOLLIN)

    def _close(self, c: Conn) -> None:
        fd = c.sock.fileno()
        if fd < 0:  # closed already (a failed send closes; its caller may close again)
            return
        self.conns.pop(fd, None)
        try:
            self.ep.unregister(fd)
        except OSError:
            pass
        c.sock.close()

    def _read(self, c: Conn) -> None:
        try:
            n = c.sock.recv_into(self.buf)
        except BlockingIOError:
            return
        except OSError:
            self._close(c)
            return
        if n == 0:
            self._close(c)
            return
        if c.port == RR:
            c.got += n
            k, c.got = divmod(c.got, RR_SIZE)
            if k:
                self._send(c, self.rr_reply * k)
        elif c.port == BULK:
            self._bulk(c, n)
        elif c.port == CONN:
            c.got += n
            if c.got >= CONN_SIZE and not c.closing:
                c.closing = True
                self._send(c, self.conn_reply)
                if not c.out:
                    self._close(c)

    def _bulk(self, c: Conn, n: int) -> None:
        data = self.view[:n]
        if c.remaining < 0:
            need = BULK_HEADER.size - len(c.header)
            c.header += bytes(data[:need])
            data = data[need:]
            if len(c.header) < BULK_HEADER.size:
                return
            c.remaining, flags = BULK_HEADER.unpack(c.header)
            c.hasher = hashlib.sha1() if flags & BULK_CHECKSUM else None
        if c.hasher is not None:
            c.hasher.update(data)
        c.got += len(data)
        c.remaining -= len(data)
        if c.remaining <= 0:
            digest = c.hasher.digest() if c.hasher is not None else bytes(20)
            self._send(c, struct.pack("!Q", c.got) + digest)
            c.remaining, c.header, c.got, c.hasher = -1, b"", 0, None

    def _send(self, c: Conn, data: bytes) -> None:
        if c.out:
            c.out += data
            return
        try:
            sent = c.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(c)
            return
        if sent < len(data):
            c.out = data[sent:]
            self.ep.modify(c.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, c: Conn) -> None:
        try:
            sent = c.sock.send(c.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(c)
            return
        c.out = c.out[sent:]
        if not c.out:
            if c.closing:
                self._close(c)
                return
            self.ep.modify(c.sock.fileno(), select.EPOLLIN)

    def _udp(self, u: socket.socket) -> None:
        for _ in range(64):
            try:
                n, addr = u.recvfrom_into(self.buf)
            except BlockingIOError:
                return
            try:
                u.sendto(self.view[:n], addr)
            except OSError:
                pass


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "server"
    workers = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--workers" else 1
    raise_nofile()
    children: list[int] = []

    def stop(*_: object) -> None:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    for _ in range(workers - 1):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            srv = Server(name)
            srv.listen()
            srv.serve()
        children.append(pid)
    srv = Server(name)
    srv.listen()
    print("ready", flush=True)
    try:
        srv.serve()
    finally:
        stop()


if __name__ == "__main__":
    main()
