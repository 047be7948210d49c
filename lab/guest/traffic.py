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
import time
from dataclasses import dataclass, field

import node
from agent import Agent
from node import CLIENT, netns
from result import Result

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
    # IPVS schedules any UDP datagram it has no connection for, so a session the relay carried
    # moves to IPVS's pick at the offload: one move is expected there (docs/platform.md, IPVS)
    may_move: bool = False
    moves: int = 0
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
                "error_count": len(self.errors), "pods": sorted(self.pods), "moves": self.moves}

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
                    self.moves += 1
                    if not self.may_move or self.moves > 1:
                        self.errors.append(f"#{seq}: moved from {sorted(self.pods)} to {pod}")
                self.pods.add(pod)
                self.exchanges += 1


def summary(flows: list[Flow]) -> tuple[list[dict[str, object]], int]:
    results = [f.stop() for f in flows]
    return results, sum(int(str(r["error_count"])) for r in results)


def held_probe(agent: Agent, ip: str, port: int, proto: str) -> dict[str, str]:
    """A new connection from the client; while it is open, which datapath /flows shows it on."""
    kind = socket.SOCK_STREAM if proto == "TCP" else socket.SOCK_DGRAM
    try:
        with client_socket(kind) as s:
            s.connect((ip, port))
            if proto == "TCP":
                s.sendall(b"probe\n")
                reply = s.makefile("rb").readline().decode()
            else:
                s.send(b"probe")
                reply = s.recv(2048).decode()
            src = f"{node.CLIENT_IP}:{s.getsockname()[1]}"
            flows = agent.get("/flows")
    except OSError as err:
        return {"pod": f"error: {err}", "carried_by": "none"}
    mine = [f.get("datapath", "?") for f in flows if f.get("original", {}).get("src") == src]
    return {"pod": reply.split(" ")[0], "carried_by": "+".join(sorted(set(mine))) or "not in /flows"}


def wait_serving(res: Result, frontends: dict[str, tuple[str, int, str]], timeout: float = 90) -> None:
    """Until a probe through each frontend is answered: the agent lists its Services before its
    relay has bound every ClusterIP (until then the node has no route and answers unreachable)."""
    start = time.monotonic()
    for spn, (ip, port, proto) in frontends.items():
        while probe(ip, port, proto).startswith("error"):
            if time.monotonic() - start > timeout:
                res.fail(f"{spn} ({ip}:{port}/{proto}) not served {timeout:.0f} s after the agent listed it")
                return
            time.sleep(0.5)
    res.data["figures"]["serving_s"] = round(time.monotonic() - start, 1)
