"""EndpointSelector: which endpoint a new connection or UDP flow goes to.

Policies: roundRobin (kube-proxy 1.0 userspace's LoadBalancerRR, pkg/proxy/userspace/roundrobin.go),
random (uniform, no modulo bias: `random.randrange`), leastConnections (fewest open flows, ties in
round-robin order). sessionAffinity ClientIP: a client IP stays on its endpoint while it connects
again within `timeout` seconds of its last connection (each new connection refreshes the timer);
the pin moves when the endpoint is removed or fails; expired pins are purged as the table grows
(amortised), so client IPs that come and go do not accumulate, and at most MAX_PINS live pins are
kept per ServicePort (the BPF datapath's affinity map is an LRU of 65,536 entries): past that the
least recently used quarter is dropped, and those clients are pinned afresh on their next
connection. A failed endpoint is skipped for a
short back-off unless every endpoint is backing off. Endpoint-set updates keep the round-robin
position meaningful and keep affinity entries of endpoints that remain (C16).

A pick is O(1) for random and roundRobin when nothing is excluded or backing off (the common case;
C17 runs 200,000 picks over 1,000 endpoints); only then are candidate lists built.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port import LBPolicy, SessionAffinity

FAIL_BACKOFF = 2.0  # seconds a failed endpoint is skipped
PURGE_MIN = 1024  # affinity entries before expired ones are first purged
MAX_PINS = 65536  # live affinity entries per ServicePort (~200 B each)
# One generator for every selector without one of its own: a Random holds ~5 KiB of state, so
# one per selector cost a 900-listener agent ~4.5 MiB; picks stay uniform and independent.
_SHARED_RNG = random.Random()


@dataclass(slots=True)
class Affinity:
    endpoint: Endpoint
    last_used: float


class EndpointSelector:
    """Picks endpoints for one ServicePort (one traffic kind)."""

    # slotted: two per ServicePort, so per-instance dicts add up on nodes with many Services
    __slots__ = ("policy", "affinity", "timeout", "clock", "rng", "endpoints", "_next", "_pins",
                 "_failed_until", "_purge_at", "active")

    def __init__(
        self,
        policy: LBPolicy = "roundRobin",
        affinity: SessionAffinity = "None",
        timeout: float = 10800.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.policy: LBPolicy = policy
        self.affinity: SessionAffinity = affinity
        self.timeout = timeout
        self.clock = clock
        self.rng = rng or _SHARED_RNG
        self.endpoints: tuple[Endpoint, ...] = ()
        self._next = 0
        self._pins: dict[str, Affinity] = {}
        self._failed_until: dict[Endpoint, float] = {}
        self._purge_at = PURGE_MIN
        self.active: dict[Endpoint, int] = {}

    def update(self, endpoints: tuple[Endpoint, ...], policy: LBPolicy, affinity: SessionAffinity,
               timeout: float) -> None:
        """New endpoint set and settings; drops pins and back-offs of endpoints that left."""
        if affinity != self.affinity or (affinity == "None"):
            self._pins.clear()
        self.policy, self.affinity, self.timeout = policy, affinity, timeout
        if endpoints == self.endpoints:
            return
        if self._pins or self._failed_until or self.active:  # else nothing to filter (a new selector)
            kept = set(endpoints)
            self._pins = {c: a for c, a in self._pins.items() if a.endpoint in kept}
            self._failed_until = {e: t for e, t in self._failed_until.items() if e in kept}
            self.active = {e: n for e, n in self.active.items() if e in kept}
        self.endpoints = endpoints
        self._next = self._next % len(endpoints) if endpoints else 0

    def pins(self) -> dict[str, Endpoint]:
        """Live affinity entries: client IP → endpoint."""
        now = self.clock()
        return {c: a.endpoint for c, a in self._pins.items() if now - a.last_used <= self.timeout}

    def pick(self, client_ip: str, exclude: Collection[Endpoint] = ()) -> Endpoint | None:
        """The endpoint for a new connection from `client_ip`, or None if there is none."""
        if not self.endpoints:
            return None
        now = self.clock()
        if self.affinity == "ClientIP":
            pin = self._pins.get(client_ip)
            if pin and now - pin.last_used <= self.timeout and pin.endpoint not in exclude:
                pin.last_used = now
                return pin.endpoint
        ep = self._choose(self._candidates(now, exclude))
        if ep is not None and self.affinity == "ClientIP":
            self._pin(client_ip, ep, now)
        return ep

    def _pin(self, client_ip: str, ep: Endpoint, now: float) -> None:
        self._pins[client_ip] = Affinity(ep, now)
        if len(self._pins) >= self._purge_at:
            self._pins = {c: a for c, a in self._pins.items() if now - a.last_used <= self.timeout}
            if len(self._pins) > MAX_PINS:
                keep = sorted(self._pins.items(), key=lambda ca: ca[1].last_used)[-(MAX_PINS * 3 // 4):]
                self._pins = dict(keep)
            self._purge_at = min(MAX_PINS + 1, max(PURGE_MIN, 2 * len(self._pins)))

    def _candidates(self, now: float, exclude: Collection[Endpoint]) -> Sequence[Endpoint]:
        if self._failed_until:
            self._failed_until = {e: t for e, t in self._failed_until.items() if t > now}
        if not exclude and not self._failed_until:
            return self.endpoints
        fresh = [e for e in self.endpoints if e not in exclude]
        healthy = [e for e in fresh if e not in self._failed_until]
        return healthy or fresh or self.endpoints

    def _choose(self, candidates: Sequence[Endpoint]) -> Endpoint | None:
        if not candidates:
            return None
        if self.policy == "random":
            return candidates[self.rng.randrange(len(candidates))]
        if self.policy == "leastConnections":
            low = min(self.active.get(e, 0) for e in candidates)
            candidates = [e for e in candidates if self.active.get(e, 0) == low]
        return self._round_robin(candidates)

    def _round_robin(self, candidates: Sequence[Endpoint]) -> Endpoint:
        n = len(self.endpoints)
        if candidates is self.endpoints:
            ep = self.endpoints[self._next % n]
            self._next = (self._next + 1) % n
            return ep
        allowed = set(candidates)
        for step in range(n):
            ep = self.endpoints[(self._next + step) % n]
            if ep in allowed:
                self._next = (self._next + step + 1) % n
                return ep
        return candidates[0]

    def failed(self, ep: Endpoint) -> None:
        """`ep` refused or timed out: back off from it and drop pins to it."""
        self._failed_until[ep] = self.clock() + FAIL_BACKOFF
        self._pins = {c: a for c, a in self._pins.items() if a.endpoint != ep}

    def opened(self, ep: Endpoint) -> None:
        self.active[ep] = self.active.get(ep, 0) + 1
        self._failed_until.pop(ep, None)

    def closed(self, ep: Endpoint) -> None:
        n = self.active.get(ep, 0) - 1
        if n > 0:
            self.active[ep] = n
        else:
            self.active.pop(ep, None)
