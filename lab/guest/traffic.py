"""Traffic from the client namespace: one-shot probes and long-lived flows.

A probe opens a new connection (or a new UDP socket), sends one line and returns the pod that
answered. A long-lived flow keeps one TCP connection (a line every 250 ms) or one connected UDP
socket (a datagram every 100 ms) talking for as long as the scenario runs, across the agent's
transitions, and counts what went wrong: no answer within 5 s, a wrong echo, a reset, or a pod
other than the one the flow started on.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from node import CLIENT, netns

ANSWER_S = 5.0  # TCG is slow and the agent may be busy; an answer later than this is an error


def client_socket(kind: int) -> socket.socket:
    with netns(CLIENT):
        s = socket.socket(socket.AF_INET, kind)
    s.settimeout(ANSWER_S)
    return s


def probe(ip: str, port: int, proto: str = "TCP") -> str:
    """One new connection (or UDP socket) to ip:port; the pod that answered, or 'error: ...'."""
    try:
        if proto == "TCP":
            with client_socket(socket.SOCK_STREAM) as s:
                s.connect((ip, port))
                s.sendall(b"probe\n")
                reply = s.makefile("rb").readline().decode()
        else:
            with client_socket(socket.SOCK_DGRAM) as s:
                s.connect((ip, port))
                s.send(b"probe")
                reply = s.recv(2048).decode()
    except OSError as err:
        return f"error: {type(err).__name__} {err}"
    pod, _, echoed = reply.strip().partition(" ")
    return pod if echoed == "probe" else f"error: bad echo {reply!r}"


def probe_many(ip: str, port: int, proto: str, n: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for _ in range(n):
        who = probe(ip, port, proto)
        seen[who] = seen.get(who, 0) + 1
    return seen


@dataclass
class Flow:
    """One long-lived TCP connection or UDP session, talking in a thread until stop()."""
    name: str
    ip: str
    port: int
    proto: str
    interval: float
    exchanges: int = 0
    errors: list[str] = field(default_factory=list)
    pods: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Flow:
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
        self._thread.start()
        return self

    def stop(self) -> dict[str, object]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * ANSWER_S + 5)
        return {"flow": self.name, "exchanges": self.exchanges, "errors": self.errors[:10],
                "error_count": len(self.errors), "pods": sorted(self.pods)}

    def _run(self) -> None:
        kind = socket.SOCK_STREAM if self.proto == "TCP" else socket.SOCK_DGRAM
        try:
            s = client_socket(kind)
            s.connect((self.ip, self.port))
        except OSError as err:
            self.errors.append(f"connect: {err}")
            return
        reader = s.makefile("rb") if self.proto == "TCP" else None
        seq = 0
        with s:
            while not self._stop.wait(self.interval):
                seq += 1
                try:
                    if reader is not None:
                        s.sendall(f"{seq}\n".encode())
                        reply = reader.readline().decode()
                        if not reply:
                            self.errors.append(f"#{seq}: connection closed")
                            return
                    else:
                        s.send(str(seq).encode())
                        reply = s.recv(2048).decode()
                        while reply.split(" ")[-1].strip() != str(seq) and int(reply.split(" ")[-1]) < seq:
                            reply = s.recv(2048).decode()  # a late answer to an earlier datagram
                except (OSError, ValueError) as err:
                    self.errors.append(f"#{seq}: {type(err).__name__} {err}")
                    if self.proto == "TCP":
                        return
                    continue
                pod, _, echoed = reply.strip().partition(" ")
                if echoed != str(seq):
                    self.errors.append(f"#{seq}: bad echo {reply!r}")
                    continue
                if self.pods and pod not in self.pods:
                    self.errors.append(f"#{seq}: moved from {sorted(self.pods)} to {pod}")
                self.pods.add(pod)
                self.exchanges += 1


def summary(flows: list[Flow]) -> tuple[list[dict[str, object]], int]:
    results = [f.stop() for f in flows]
    return results, sum(int(str(r["error_count"])) for r in results)
