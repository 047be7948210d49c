"""One flow's traffic from one source: `run(Spec)` in the calling thread's netns, or as a script
(`probe.py JSON`, printing the result as JSON) for clients that must run in a cgroup (BPF).

Each attempt uses a fresh socket bound to the source address. TCP: connect, read the endpoint's
line ("IP:PORT PEER"). UDP: a connected socket, one datagram, one answer ("IP:PORT|PEER|..").
HTTP: GET / and the status line (a health check port). The result lists, per attempt, either
the answer (endpoint, peer seen) or the error name (errno name, "timeout", "closed") with how
long it took in seconds.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Spec:
    mode: str  # "tcp" | "udp" | "http"
    src: str
    dst: str
    port: int
    attempts: int
    timeout: float  # seconds per attempt


@dataclass(frozen=True, slots=True)
class Attempt:
    endpoint: str  # "IP:PORT", the HTTP status line, or "" on error
    peer: str  # the source address the endpoint saw ("" on error or HTTP)
    error: str  # "" when answered
    seconds: float


def _error_name(err: OSError) -> str:
    if isinstance(err, TimeoutError):
        return "timeout"
    return errno.errorcode.get(err.errno or 0, type(err).__name__)


def _tcp(spec: Spec) -> tuple[str, str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(spec.timeout)
        s.bind((spec.src, 0))
        s.connect((spec.dst, spec.port))
        if spec.mode == "http":
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while b"\n" not in data:
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    line = data.split(b"\n")[0].decode(errors="replace").strip()
    if not line:
        raise ConnectionResetError(errno.ECONNRESET, "closed without an answer")
    if spec.mode == "http":
        return line, ""
    endpoint, peer = line.split()[:2]
    return endpoint, peer


def _udp(spec: Spec) -> tuple[str, str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(spec.timeout)
        s.bind((spec.src, 0))
        s.connect((spec.dst, spec.port))
        s.send(b"probe")
        endpoint, peer = s.recv(65535).decode(errors="replace").split("|")[:2]
    return endpoint, peer


def run(spec: Spec) -> list[Attempt]:
    out = []
    for _ in range(spec.attempts):
        t0 = time.monotonic()
        try:
            endpoint, peer = _udp(spec) if spec.mode == "udp" else _tcp(spec)
            out.append(Attempt(endpoint, peer, "", time.monotonic() - t0))
        except OSError as err:
            out.append(Attempt("", "", _error_name(err), time.monotonic() - t0))
    return out


def main() -> None:
    spec = Spec(**json.loads(sys.argv[1]))
    print(json.dumps([asdict(a) for a in run(spec)]), flush=True)


if __name__ == "__main__":
    main()
