"""The tour's client: the same connections through every mode, from the node itself.

    python -m usproxy.tour.client

Runs in the node's network namespace and in the tour's cgroup (the BPF socket load balancer
translates only the connections of processes in it; nothing else depends on it), so every mode
sees the same traffic: connections made on the node to a ClusterIP. Commands come on stdin as
one JSON object per line; each answer is one JSON line on stdout.

A connection: connect, read the endpoint's answer (its address) to the endpoint's FIN, close.
Nothing is sent, so the only costs are the handshake, the datapath's choice and one answer. Its
latency runs from the connect() call to the FIN. Connections that fail (refused, reset, no
answer within TIMEOUT) count as errors and are not retried.

- {"op": "window", "ip", "port", "conc", "seconds"}: `conc` connections in flight for `seconds`;
  answers connections, errors, seconds, by_endpoint.
- {"op": "sequential", "ip", "port", "count"}: one connection at a time; answers latencies_us too.
- {"op": "count", "ip", "port", "conc", "count"}: exactly `count` connections, `conc` in flight.
- {"op": "until", "ip", "port", "endpoint", "timeout", "interval"}: a connection every
  `interval` s; prints {"polling": true} after the first answer, then {"t": the monotonic time
  the first connection answered by `endpoint` was started (null if none within `timeout`)}.

CLOCK_MONOTONIC is one clock for every process of the machine, so the tour compares `t` with
the time it wrote the manifest. Stdlib only, one thread, epoll.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TIMEOUT = 3.0  # seconds a connection may take before it counts as an error


@dataclass
class Tally:
    """What a run of connections gave."""

    connections: int = 0
    errors: int = 0
    by_endpoint: dict[str, int] = field(default_factory=dict)
    latencies_us: list[float] = field(default_factory=list)
    first_error: str = ""

    def ok(self, answer: bytes, latency: float) -> str:
        ep = answer.decode(errors="replace").strip()
        self.connections += 1
        self.by_endpoint[ep] = self.by_endpoint.get(ep, 0) + 1
        self.latencies_us.append(latency * 1e6)
        return ep

    def failed(self, why: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or why


class _Conn:
    __slots__ = ("sock", "t0", "buf")

    def __init__(self, sock: socket.socket, t0: float) -> None:
        self.sock, self.t0, self.buf = sock, t0, b""


def drive(ip: str, port: int, conc: int, more: Callable[[int], bool], tally: Tally) -> None:
    """Keep up to `conc` connections in flight while more(started) says so; wait for the last."""
    ep = select.epoll()
    live: dict[int, _Conn] = {}
    started = 0
    try:
        while True:
            while len(live) < conc and more(started):
                started += 1
                c = _open(ip, port, tally)
                if c is not None:
                    live[c.sock.fileno()] = c
                    ep.register(c.sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            if not live:
                if not more(started):
                    return
                continue
            for fd, _ in ep.poll(0.05):
                c = live[fd]
                done = _read(c, tally)
                if done:
                    ep.unregister(fd)
                    c.sock.close()
                    del live[fd]
            now = time.monotonic()
            for fd, c in [(fd, c) for fd, c in live.items() if now - c.t0 > TIMEOUT]:
                tally.failed("timed out")
                ep.unregister(fd)
                c.sock.close()
                del live[fd]
    finally:
        for c in live.values():
            c.sock.close()
        ep.close()


def _open(ip: str, port: int, tally: Tally) -> _Conn | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    t0 = time.monotonic()
    rc = s.connect_ex((ip, port))
    if rc not in (0, errno.EINPROGRESS):
        s.close()
        tally.failed(errno.errorcode.get(rc, str(rc)))
        return None
    return _Conn(s, t0)


def _read(c: _Conn, tally: Tally) -> bool:
    """Read what is there; True once the connection is done (answered to FIN, or failed)."""
    while True:
        try:
            data = c.sock.recv(256)
        except BlockingIOError:
            return False
        except OSError as err:
            tally.failed(errno.errorcode.get(err.errno or 0, str(err)))
            return True
        if not data:
            if c.buf:
                tally.ok(c.buf, time.monotonic() - c.t0)
            else:
                tally.failed("closed without an answer")
            return True
        c.buf += data


def window(spec: dict[str, Any]) -> dict[str, Any]:
    tally = Tally()
    t0 = time.monotonic()
    end = t0 + float(spec["seconds"])
    drive(spec["ip"], int(spec["port"]), int(spec["conc"]), lambda _: time.monotonic() < end, tally)
    return _answer(tally, time.monotonic() - t0)


def count(spec: dict[str, Any], conc: int | None = None) -> dict[str, Any]:
    tally = Tally()
    n = int(spec["count"])
    t0 = time.monotonic()
    drive(spec["ip"], int(spec["port"]), conc or int(spec["conc"]), lambda started: started < n, tally)
    return _answer(tally, time.monotonic() - t0)


def sequential(spec: dict[str, Any]) -> dict[str, Any]:
    out = count(spec, conc=1)
    return out


def until(spec: dict[str, Any], say: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Poll until `endpoint` answers; tell `say` once polling answers at all."""
    want, interval = spec["endpoint"], float(spec.get("interval", 0.002))
    deadline = time.monotonic() + float(spec["timeout"])
    tally, told = Tally(), False
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        one = Tally()
        drive(spec["ip"], int(spec["port"]), 1, lambda started: started < 1, one)
        tally.connections += one.connections
        tally.errors += one.errors
        for ep, n in one.by_endpoint.items():
            tally.by_endpoint[ep] = tally.by_endpoint.get(ep, 0) + n
        if one.connections and not told:
            say({"polling": True})
            told = True
        if one.by_endpoint.get(want):
            return {"t": t0, "connections": tally.connections, "errors": tally.errors, "by_endpoint": tally.by_endpoint}
        time.sleep(interval)
    return {"t": None, "connections": tally.connections, "errors": tally.errors, "by_endpoint": tally.by_endpoint}


def _answer(tally: Tally, seconds: float) -> dict[str, Any]:
    return {"connections": tally.connections, "errors": tally.errors, "seconds": seconds,
            "by_endpoint": tally.by_endpoint, "latencies_us": tally.latencies_us, "first_error": tally.first_error}


def main() -> int:
    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        op = spec["op"]
        if op == "window":
            out = window(spec)
            out.pop("latencies_us")  # conc > 1: queueing, not the path; sequential measures latency
        elif op == "count":
            out = count(spec)
            out.pop("latencies_us")
        elif op == "sequential":
            out = sequential(spec)
        elif op == "until":
            out = until(spec, say)
        else:
            out = {"error": f"unknown op {op!r}"}
        say(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
