"""UDP backend for the UDP relay tests, run inside a pod netns:
`python3 udp_backends.py NAME ADDR PORT [--log FILE] [--mute]`.

It answers each datagram with b"NAME|" + payload, or, when that would not fit in one datagram
(65,507 bytes over IPv4, 65,527 over IPv6), with b"NAME|len=<n>|sha256=<hex>", so the test can
still check a maximum-size datagram arrived intact. A payload that starts with b"delay=<ms>;" is
answered after that many milliseconds, without holding up other datagrams (C08's slow backend).
With --log it appends one line per datagram and flushes it at once:
"<monotonic time> <peer ip> <peer port> <length> <hex of the first 16 bytes>".
With --mute it never answers (C03's one-way sink). Stdlib only, single-threaded: one socket, one heap of delayed answers, select().
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import select
import socket
import time
from typing import IO

MAX_REPLY = {socket.AF_INET: 65507, socket.AF_INET6: 65527}


def answer(name: bytes, data: bytes, limit: int) -> bytes:
    out = name + b"|" + data
    if len(out) <= limit:
        return out
    return name + b"|len=%d|sha256=%s" % (len(data), hashlib.sha256(data).hexdigest().encode())


def delay_of(data: bytes) -> float:
    if not data.startswith(b"delay="):
        return 0.0
    head = data[6:].split(b";", 1)[0]
    return int(head) / 1000 if head.isdigit() else 0.0


def serve(name: bytes, sock: socket.socket, log: IO[str] | None, mute: bool) -> None:
    limit = MAX_REPLY[sock.family]
    pending: list[tuple[float, int, bytes, tuple[str, int]]] = []
    seq = 0
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        if select.select([sock], [], [], timeout)[0]:
            data, peer = sock.recvfrom(65535)
            if log is not None:
                log.write(f"{time.monotonic():.6f} {peer[0]} {peer[1]} {len(data)} {data[:16].hex()}\n")
                log.flush()
            seq += 1
            if not mute:
                heapq.heappush(pending, (time.monotonic() + delay_of(data), seq, data, peer))
        while pending and pending[0][0] <= time.monotonic():
            _, _, data, peer = heapq.heappop(pending)
            try:
                sock.sendto(answer(name, data, limit), peer)
            except OSError:
                pass  # e.g. the proxy's flow socket was closed meanwhile (ICMP back): not our fault


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("addr")
    p.add_argument("port", type=int)
    p.add_argument("--log")
    p.add_argument("--mute", action="store_true")
    a = p.parse_args()
    sock = socket.socket(socket.AF_INET6 if ":" in a.addr else socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((a.addr, a.port))
    log = open(a.log, "a") if a.log else None
    print("ready", flush=True)
    serve(a.name.encode(), sock, log, a.mute)


if __name__ == "__main__":
    main()
