"""Bench client for the BPF contender: one measurement against bench.servers, one JSON line out.

  bpf_client.py bulk HOST MIB        upload MIB MiB on one connection (BULK port): MB/s
  bpf_client.py conn HOST N          N connections, 64-byte request/answer each (CONN port): conns/s
  bpf_client.py rr HOST N            N 1 KiB round trips on one connection (RR port): round trips/s
  bpf_client.py udp HOST N           N echo round trips on one unconnected UDP socket: round trips/s

Timing starts after imports and ends when the last answer arrived; CPU time of this process is
reported too. The same client measures every contender, so only the path differs.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

BULK, RR, CONN, UDP = 5001, 5002, 5003, 5004
CHUNK = 1 << 20


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("short read")
        buf += got
    return bytes(buf)


def bulk(host: str, mib: int) -> float:
    payload = memoryview(b"\0" * CHUNK)
    s = socket.create_connection((host, BULK))
    s.sendall(struct.pack("!QQ", mib * CHUNK, 0))
    for _ in range(mib):
        s.sendall(payload)
    assert struct.unpack("!Q", _recv_exact(s, 8))[0] == mib * CHUNK
    s.close()
    return mib * CHUNK / 1e6


def conn(host: str, n: int) -> float:
    req = b"c" * 64
    for _ in range(n):
        s = socket.create_connection((host, CONN))
        s.sendall(req)
        _recv_exact(s, 64)
        s.close()
    return float(n)


def rr(host: str, n: int) -> float:
    req = b"q" * 1024
    s = socket.create_connection((host, RR))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(n):
        s.sendall(req)
        _recv_exact(s, 1024)
    s.close()
    return float(n)


def udp(host: str, n: int) -> float:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    for i in range(n):
        s.sendto(b"u%d" % i, (host, UDP))
        s.recvfrom(2048)
    s.close()
    return float(n)


def main() -> None:
    what, host, amount = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fn = {"bulk": bulk, "conn": conn, "rr": rr, "udp": udp}[what]
    t0, c0 = time.perf_counter(), os.times()
    units = fn(host, amount)
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps({"what": what, "rate": units / wall, "wall": wall, "client_cpu": cpu}))


if __name__ == "__main__":
    main()
