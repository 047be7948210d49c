"""The bench client: the same tool for every contender, run in the client netns.

`python -m bench.clients '<json spec>'` prints one JSON result. Specs (`op`):
- bulk: one stream of `bytes` to BULK; with `checksum` the server's SHA-1 is compared to ours.
- rr: `conc` keep-alive connections, 1 KiB request/response, counted inside [start, end].
- conn: short connections (connect, 64 B each way, server closes first), `conc` in flight,
  source addresses spread over `sources`, ports picked at connect time (IP_BIND_ADDRESS_NO_PORT).
- latency: open-loop requests at `rate`/s over `conc` connections; p50/p99 of each round trip.
- udp: `conc` connected sockets, one datagram of `size` in flight each; lost ones resent after 200 ms.
- hold: `n` idle connections to HOLD; prints "ready", closes all when stdin closes.
- until: polls CONN until the answering server's name is `name`; prints the monotonic time.
`procs` > 1 forks that many workers sharing the same measurement window; results are summed.
Pure stdlib with epoll, one syscall pair per request: cheap next to any proxy it measures.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.servers import BULK, BULK_CHECKSUM, BULK_HEADER, CONN, CONN_SIZE, HOLD, RR, RR_SIZE, UDP

Spec = dict[str, Any]
Result = dict[str, Any]
IP_BIND_ADDRESS_NO_PORT = 24
CHUNK = 1 << 20


def _connect(target: str, port: int, source: str | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source is not None:
        s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect((target, port))
    return s


# -- bulk ----------------------------------------------------------------------------------------
def bulk(spec: Spec) -> Result:
    total = int(spec["bytes"])
    check = bool(spec.get("checksum"))
    block = bytearray(os.urandom(CHUNK))
    hasher = hashlib.sha1() if check else None
    s = _connect(spec["target"], BULK)
    t0 = time.monotonic()
    s.sendall(BULK_HEADER.pack(total, BULK_CHECKSUM if check else 0))
    view = memoryview(block)
    sent, i = 0, 0
    while sent < total:
        n = min(CHUNK, total - sent)
        if check:
            block[:8] = struct.pack("!Q", i)  # every chunk differs: a lost or repeated one shows
            assert hasher is not None
            hasher.update(view[:n])
        s.sendall(view[:n])
        sent += n
        i += 1
    answer = _recv_exact(s, 28)
    t1 = time.monotonic()
    s.close()
    got = struct.unpack("!Q", answer[:8])[0]
    ok = None if hasher is None else (answer[8:] == hasher.digest() and got == total)
    return {"bytes": total, "received": got, "seconds": t1 - t0, "checksum_ok": ok}


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed early")
        out += chunk
    return out


# -- request/response ------------------------------------------------------------------------------
def rr(spec: Spec) -> Result:
    conc = int(spec["conc"])
    socks = [_connect(spec["target"], RR) for _ in range(conc)]
    ep = select.epoll()
    got: dict[int, int] = {}
    by_fd: dict[int, socket.socket] = {}
    for s in socks:
        s.setblocking(False)
        by_fd[s.fileno()] = s
        got[s.fileno()] = 0
        ep.register(s.fileno(), select.EPOLLIN)
    req = b"q" * RR_SIZE
    buf = bytearray(65536)
    start, end = float(spec["start"]), float(spec["end"])
    count = 0
    for s in socks:
        s.send(req)
    now = time.monotonic()
    while now < end:
        for fd, _ in ep.poll(0.05):
            s = by_fd[fd]
            n = s.recv_into(buf)
            if n == 0:
                raise ConnectionError("rr connection closed")
            k, got[fd] = divmod(got[fd] + n, RR_SIZE)
            for _ in range(k):
                s.send(req)
            if now >= start:
                count += k
        now = time.monotonic()
    for s in socks:
        s.close()
    return {"requests": count, "seconds": end - start}


# -- short connections -----------------------------------------------------------------------------
def conn(spec: Spec) -> Result:
    target, conc = spec["target"], int(spec["conc"])
    sources: list[str] = spec.get("sources") or [None]
    start, end = float(spec["start"]), float(spec["end"])
    ep = select.epoll()
    live: dict[int, tuple[socket.socket, list[int]]] = {}
    req = b"c" * CONN_SIZE
    count = errors = 0
    nxt = 0

    def open_one() -> None:
        nonlocal nxt, errors
        src = sources[nxt % len(sources)]
        nxt += 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if src is not None:
                s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                s.bind((src, 0))
            s.setblocking(False)
            s.connect_ex((target, CONN))
        except OSError:
            errors += 1
            s.close()
            return
        live[s.fileno()] = (s, [0])
        ep.register(s.fileno(), select.EPOLLOUT)

    def finish(fd: int, ok: bool, now: float) -> None:
        nonlocal count, errors
        s, _ = live.pop(fd)
        ep.unregister(fd)
        s.close()
        if ok:
            count += now >= start
        else:
            errors += 1
        if now < end:
            open_one()

    for _ in range(conc):
        open_one()
    now = time.monotonic()
    while live and now < end + 2.0:
        for fd, ev in ep.poll(0.05):
            now = time.monotonic()
            s, got = live[fd]
            if ev & select.EPOLLOUT and got[0] == 0 and not ev & select.EPOLLIN:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    finish(fd, False, now)
                    continue
                s.send(req)
                got[0] = -1  # sent, now reading
                ep.modify(fd, select.EPOLLIN)
                continue
            try:
                data = s.recv(256)
            except BlockingIOError:
                continue
            except OSError:
                finish(fd, False, now)
                continue
            if data:
                got[0] = max(got[0], 0) + len(data)
                continue
            finish(fd, got[0] >= CONN_SIZE, now)
        now = time.monotonic()
    for s, _ in live.values():
        s.close()
    return {"conns": count, "errors": errors, "seconds": end - start}


# -- latency at a fixed rate -------------------------------------------------------------------------
def latency(spec: Spec) -> Result:
    rate, conc = float(spec["rate"]), int(spec["conc"])
    socks = [_connect(spec["target"], RR) for _ in range(conc)]
    ep = select.epoll()
    by_fd = {s.fileno(): s for s in socks}
    for s in socks:
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLIN)
    idle = list(by_fd)
    sent_at: dict[int, float] = {}
    got = dict.fromkeys(by_fd, 0)
    req = b"q" * RR_SIZE
    buf = bytearray(65536)
    start, end = float(spec["start"]), float(spec["end"])
    lats: list[float] = []
    interval = 1.0 / rate
    due = time.monotonic()
    backlog = 0
    now = due
    while now < end:
        while due <= now:  # open loop: requests fall due whether or not earlier ones finished
            backlog += 1
            due += interval
        while backlog and idle:
            fd = idle.pop()
            by_fd[fd].send(req)
            sent_at[fd] = time.monotonic()
            backlog -= 1
        for fd, _ in ep.poll(max(0.0, due - now)):
            n = by_fd[fd].recv_into(buf)
            if n == 0:
                raise ConnectionError("latency connection closed")
            got[fd] += n
            if got[fd] >= RR_SIZE:
                got[fd] -= RR_SIZE
                t = time.monotonic()
                if t >= start:
                    lats.append(t - sent_at[fd])
                if backlog:
                    by_fd[fd].send(req)
                    sent_at[fd] = time.monotonic()
                    backlog -= 1
                else:
                    idle.append(fd)
        now = time.monotonic()
    for s in socks:
        s.close()
    lats.sort()
    return {"samples": len(lats), "seconds": end - start, "lats_us": _percentiles(lats),
            "backlog_end": backlog}


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {f"p{p:g}": xs[min(len(xs) - 1, int(len(xs) * p / 100))] * 1e6 for p in (50, 90, 99, 99.9)}


# -- UDP ---------------------------------------------------------------------------------------------
def udp(spec: Spec) -> Result:
    size, conc = int(spec["size"]), int(spec["conc"])
    start, end = float(spec["start"]), float(spec["end"])
    ep = select.epoll()
    socks: dict[int, socket.socket] = {}
    last: dict[int, float] = {}
    payload = b"u" * size
    for _ in range(conc):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((spec["target"], UDP))
        s.setblocking(False)
        socks[s.fileno()] = s
        ep.register(s.fileno(), select.EPOLLIN)
    buf = bytearray(65536)
    count = lost = 0
    now = time.monotonic()
    for fd, s in socks.items():
        s.send(payload)
        last[fd] = now
    check = now + 0.05
    while now < end:
        for fd, _ in ep.poll(0.05):
            s = socks[fd]
            try:
                n = s.recv_into(buf)
            except (BlockingIOError, ConnectionRefusedError):
                continue
            if n == size and now >= start:
                count += 1
            s.send(payload)
            last[fd] = now
        now = time.monotonic()
        if now >= check:
            for fd, t in last.items():
                if now - t > 0.2:
                    lost += 1
                    try:
                        socks[fd].send(payload)
                    except OSError:
                        pass
                    last[fd] = now
            check = now + 0.05
    for s in socks.values():
        s.close()
    return {"requests": count, "lost": lost, "seconds": end - start}


# -- idle connections, reachability --------------------------------------------------------------------
def hold(spec: Spec) -> Result:
    socks = [_connect(spec["target"], HOLD) for _ in range(int(spec["n"]))]
    print(json.dumps({"ready": len(socks)}), flush=True)
    sys.stdin.read()
    for s in socks:
        s.close()
    return {"held": len(socks)}


def until(spec: Spec) -> Result:
    """Connect to CONN every `interval` until the answer names `name`; returns when (monotonic)."""
    deadline = time.monotonic() + float(spec.get("timeout", 30))
    want = spec["name"].encode()
    tries = 0
    print(json.dumps({"polling": True}), flush=True)
    while time.monotonic() < deadline:
        tries += 1
        try:
            s = _connect(spec["target"], CONN)
            s.settimeout(1.0)
            s.sendall(b"c" * CONN_SIZE)
            answer = s.recv(CONN_SIZE)
            s.close()
            if answer.rstrip(b".") == want:  # exact: "srv" must not match "srv2"
                return {"t": time.monotonic(), "tries": tries}
        except OSError:
            pass
        time.sleep(float(spec.get("interval", 0.002)))
    return {"t": None, "tries": tries}


OPS: dict[str, Callable[[Spec], Result]] = {
    "bulk": bulk, "rr": rr, "conn": conn, "latency": latency, "udp": udp, "hold": hold, "until": until}
SUMMED = ("requests", "conns", "errors", "lost", "samples")


def fan_out(op: Callable[[Spec], Result], spec: Spec, procs: int) -> Result:
    """Run `op` in `procs` forked workers with the same window; sum the counters."""
    if procs <= 1:
        return op(spec)
    pipes = []
    for i in range(procs):
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)
            sub = dict(spec, conc=max(1, int(spec["conc"]) // procs), worker=i)
            if spec.get("sources"):
                sub["sources"] = spec["sources"][i::procs] or spec["sources"]
            os.write(w, json.dumps(op(sub)).encode())
            os._exit(0)
        os.close(w)
        pipes.append(r)
    results = []
    for r in pipes:
        with os.fdopen(r) as f:
            results.append(json.loads(f.read() or "{}"))
    for _ in pipes:
        os.wait()
    out: Result = {"procs": procs, "seconds": results[0].get("seconds")}
    for key in SUMMED:
        if any(key in x for x in results):
            out[key] = sum(int(x.get(key, 0)) for x in results)
    return out


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec: Spec = json.loads(sys.argv[1])
    now = time.monotonic()
    spec.setdefault("start", now + float(spec.get("warmup", 0.3)))
    spec.setdefault("end", spec["start"] + float(spec.get("duration", 2.0)))
    result = fan_out(OPS[spec["op"]], spec, int(spec.get("procs", 1)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
