"""C15: ClientIP affinity through the relay: stickiness, and the timeout's exact semantics.

Fault class: affinity timing semantics: the unit of timeoutSeconds, what refreshes the timer (each
new connection, nothing else: not lingering or TIME_WAIT sockets), expiry at the last new
connection + timeoutSeconds (±1 s), and picking up a changed timeout for existing entries.

Setup as in the case (3 backends, ClientIP with timeoutSeconds 5, clients 10.244.9.10..39). The
default policy is roundRobin, so a pick after expiry from a client that alone uses a Service moves
to the next backend: expiry is seen as a change of backend. To run in about 16 s, two Services with
the same spec run side by side: `sticky` for the single-client timeline and `sticky2` for the 30
client IPs and then the timeout change (with its own client IP, .40, so its round robin is not
shared). Reductions, each keeping the ±1 s thresholds:
- (1) 50 connections 20 ms apart instead of 100 ms apart.
- (2) instead of 11 connections 3 s apart, connections at last + 4 s and + 8 s (timeout − 1 apart:
  the second is past last + 5 s, so it only stays sticky if the first refreshed the timer).
- (3) the 30 expiries happen at once, one per client IP of (4), not one after another; the single
  client's expiry is checked at last + 6 s (timeout + 1) after staying put at last + 4 s.
- (5) an entry last used at L, with the timeout lowered to 2 at L + 1.5 s (T_upd): expired at
  max(T_upd + 1 s, L + 3 s) (it would have lived to L + 5 under the old timeout); then expiry at
  last + 3 s (new timeout + 1) after staying put at last + 1 s (new timeout − 1).
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import ask_in

pytestmark = pytest.mark.netns

STICKY, STICKY2 = "10.96.110.110", "10.96.110.112"
BACKENDS = {"be-a": "10.244.1.20", "be-b": "10.244.2.20", "be-c": "10.244.3.20"}
CLIENTS = [f"10.244.9.{i}" for i in range(10, 40)]
LONE = "10.244.9.40"  # step 5's client on sticky2


def objects(timeout2: int = 5) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, vip, timeout in (("sticky", STICKY, 5), ("sticky2", STICKY2, timeout2)):
        out += [svc(name, vip, [{"port": 80, "targetPort": 8080}], sessionAffinity="ClientIP",
                    sessionAffinityConfig={"clientIP": {"timeoutSeconds": timeout}}),
                slice_(name, [{"ip": ip, "ready": True} for ip in BACKENDS.values()],
                       [{"port": 8080, "protocol": "TCP"}])]
    return out


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


class Client:
    """One client IP in the client netns; `last` is when its latest connection was answered."""

    def __init__(self, ns: str, source: str, vip: str) -> None:
        self.ns, self.source, self.vip = ns, source, vip
        self.last = 0.0

    def ask(self, at: float = 0.0) -> str:
        sleep_until(at)
        name = ask_in(self.ns, self.vip, 80, self.source)
        self.last = time.monotonic()
        return name

    def group(self, n: int, spacing: float = 0.0) -> set[str]:
        names = set()
        for _ in range(n):
            names.add(self.ask())
            time.sleep(spacing)
        return names


def single_client_timeline(ns: str) -> None:
    """Steps 1-3 on `sticky`, alone on that Service."""
    c = Client(ns, CLIENTS[0], STICKY)
    first = c.group(50, spacing=0.02)
    assert len(first) == 1, f"(1) 50 connections spread over {first}"
    (x,) = first
    assert c.ask(at=c.last + 4.0) == x, "(2) expired before timeout - 1"
    assert c.ask(at=c.last + 4.0) == x, "(2) a new connection did not refresh the timer"
    y = c.ask(at=c.last + 6.0)
    assert y != x, "(3) not expired at timeout + 1"
    assert c.group(5) == {y}, "(3) not sticky after expiry"


def many_clients_then_timeout_change(ns: str, m: Manifests) -> None:
    """Steps 4 and 3 with 30 client IPs, then step 5, on `sticky2`."""
    clients = [Client(ns, ip, STICKY2) for ip in CLIENTS]
    seen: dict[str, set[str]] = {c.source: set() for c in clients}
    for _ in range(10):
        for c in clients:
            seen[c.source].add(c.ask())
    assert all(len(s) == 1 for s in seen.values()), f"(4) not sticky: {seen}"
    per_backend = Counter(next(iter(s)) for s in seen.values())
    assert set(per_backend) == set(BACKENDS) and min(per_backend.values()) >= 3, per_backend
    sleep_until(max(c.last for c in clients) + 7.0)
    after = {c.source: c.group(5) for c in clients}
    assert all(len(s) == 1 for s in after.values()), f"(3) groups of 5 not sticky: {after}"
    assert len({next(iter(s)) for s in after.values()}) >= 2, "(3) every expiry chose the same backend"

    lone = Client(ns, LONE, STICKY2)
    y = lone.ask()
    assert lone.group(4) == {y}
    sleep_until(lone.last + 1.5)
    t_upd = m.write(*objects(timeout2=2))
    z = lone.ask(at=max(t_upd + 1.0, lone.last + 3.0))
    assert z != y, "(5) the lowered timeout did not apply to the existing entry within 1 s"
    assert lone.ask(at=lone.last + 1.0) == z, "(5) expired before the new timeout - 1"
    assert lone.ask(at=lone.last + 3.0) != z, "(5) not expired at the new timeout + 1"


def test_affinity_timing(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    for name, ip in BACKENDS.items():
        backends.start(topology.add_host(name, ip), "idsrv", name, ip, "8080")
    cli = topology.add_host("cli", *CLIENTS, LONE)
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        with ThreadPoolExecutor(2) as pool:
            one = pool.submit(single_client_timeline, cli)
            many = pool.submit(many_clients_then_timeout_change, cli, m)
            one.result()
            many.result()
    finally:
        assert agent.stop() == 0
