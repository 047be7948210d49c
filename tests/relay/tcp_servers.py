"""TCP backend programs for the relay's field-case tests, run inside pod netns.

`python3 tcp_servers.py MODE ADDR PORT [options]`; prints "ready" once listening. Stdlib only.

eofsrv --order client-first [--delay D]: read to EOF, sleep D seconds, send sha256(input) (32 bytes)
  and then 1 MiB of `pattern`, close (C09 1, 2).
eofsrv --order server-first --log FILE: send 1 MiB of `pattern`, shutdown(SHUT_WR), read to EOF,
  append "<peer ip>:<port> <bytes read>" to FILE (the side channel of C09 3).
blob: read an 8-byte big-endian length L, write the first L bytes of `pattern`, close() at once (C11).
upload [--log FILE]: read to EOF, reply sha256 (32 bytes) + byte count (8 bytes, big-endian), close
  (C11); with --log appends "<peer ip>:<port> eof <bytes>", or "... reset <bytes>" on ECONNRESET.
hello --name NAME: write "NAME\n" and close at once (the server closes first, so the proxy does too).
abortsrv [--after N]: send N bytes of `pattern`, then abort the connection (RST, SO_LINGER 0).
flood --after L --log FILE: write L bytes of `pattern` as fast as the peer takes them, never reading;
  every 0.1 s FILE is replaced by "<connections> <bytes written in all> <most written to one>" (the
  writes a proxy's backpressure stalls: issue 18's memory test).
blob and abortsrv with --log append "<monotonic time> accept <peer ip>:<port>" per connection.

`pattern` is a seeded pseudo-random block of a prime length (1,000,003 bytes) repeated: cheap to
produce at any length, and a lost, duplicated or reordered read of any size other than a multiple of
the block changes the sha256. Clients import `pattern_digest` and `PATTERN` from here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

BLOCK = 1_000_003
PATTERN = random.Random(20240601).randbytes(BLOCK)
_DOUBLE = memoryview(PATTERN * 2)
MIB = 1 << 20


def pattern_chunks(length: int, offset: int = 0, chunk: int = 256 * 1024) -> Iterator[memoryview]:
    """The bytes [offset, offset + length) of the endless pattern, in slices of at most `chunk`."""
    pos, end = offset, offset + length
    while pos < end:
        start = pos % BLOCK
        n = min(chunk, end - pos, BLOCK)
        yield _DOUBLE[start:start + n]
        pos += n


def pattern_digest(length: int) -> bytes:
    h = hashlib.sha256()
    for part in pattern_chunks(length, chunk=BLOCK):
        h.update(part)
    return h.digest()


def send_pattern(conn: socket.socket, length: int) -> None:
    for part in pattern_chunks(length):
        conn.sendall(part)


def read_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = conn.recv(n - len(buf))
        if not data:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def drain(conn: socket.socket, counter: list[int] | None = None) -> tuple[int, bytes]:
    """Read to EOF; returns (byte count, sha256). `counter[0]` follows the count as it grows."""
    h, n = hashlib.sha256(), 0
    buf = bytearray(MIB)
    while True:
        got = conn.recv_into(buf)
        if not got:
            return n, h.digest()
        h.update(memoryview(buf)[:got])
        n += got
        if counter is not None:
            counter[0] = n


def _append(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def eofsrv(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        if args.order == "client-first":
            _, digest = drain(conn)
            time.sleep(args.delay)
            conn.sendall(digest)
            send_pattern(conn, MIB)
        else:
            send_pattern(conn, MIB)
            conn.shutdown(socket.SHUT_WR)
            n, _ = drain(conn)
            _append(args.log, f"{peer[0]}:{peer[1]} {n}")
    return handle


def blob(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        (length,) = struct.unpack("!Q", read_exact(conn, 8))
        send_pattern(conn, length)
    return handle


def upload(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        counter = [0]
        try:
            n, digest = drain(conn, counter)
        except ConnectionResetError:
            _append(args.log, f"{peer[0]}:{peer[1]} reset {counter[0]}")
            raise
        _append(args.log, f"{peer[0]}:{peer[1]} eof {n}")
        conn.sendall(digest + struct.pack("!Q", n))
    return handle


def abortsrv(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        send_pattern(conn, args.after)
        time.sleep(0.05)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return handle


def hello(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        conn.sendall(args.name.encode() + b"\n")
    return handle


def flood(args: argparse.Namespace) -> Callable[[socket.socket, tuple[str, int]], None]:
    written: list[list[int]] = []

    def report() -> None:
        while True:
            counts = [c[0] for c in list(written)]
            tmp = args.log + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{len(counts)} {sum(counts)} {max(counts, default=0)}\n")
            os.replace(tmp, args.log)
            time.sleep(0.1)

    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        mine = [0]
        written.append(mine)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # the kernel's share small
        for part in pattern_chunks(args.after, chunk=64 * 1024):
            view = part
            while view:
                n = conn.send(view)
                mine[0] += n
                view = view[n:]
    threading.Thread(target=report, daemon=True).start()
    return handle


MODES = {"eofsrv": eofsrv, "flood": flood, "blob": blob, "upload": upload, "abortsrv": abortsrv, "hello": hello}


def serve(args: argparse.Namespace) -> None:
    handler = MODES[args.mode](args)
    srv = socket.socket(socket.AF_INET6 if ":" in args.addr else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((args.addr, args.port))
    srv.listen(4096)
    print("ready", flush=True)
    while True:
        conn, peer = srv.accept()
        if args.mode in ("blob", "abortsrv"):
            _append(args.log, f"{time.monotonic():.6f} accept {peer[0]}:{peer[1]}")
        threading.Thread(target=_run, args=(handler, conn, peer), daemon=True).start()


def _run(handler: Callable[[socket.socket, tuple[str, int]], None], conn: socket.socket,
         peer: tuple[str, int]) -> None:
    try:
        handler(conn, peer)
    except (OSError, EOFError):
        pass
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("addr")
    p.add_argument("port", type=int)
    p.add_argument("--order", choices=["client-first", "server-first"], default="client-first")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--after", type=int, default=64 * 1024)
    p.add_argument("--log")
    p.add_argument("--name", default="")
    serve(p.parse_args())


if __name__ == "__main__":
    main()
