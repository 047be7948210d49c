"""Flow and FlowTable: usproxy's own conntrack for relayed traffic.

A Flow has an original tuple (client → frontend, i.e. ClusterIP:port or node:NodePort) and a reply
tuple (endpoint → the proxy's local address), bytes and packets each way (a "packet" is one read
or one datagram), state (a FlowState, named as the kernel's conntrack names them), start and last
activity (monotonic seconds). The table is bounded by
`max_flows` (kube-proxy's conntrack max rule; see ProxyConfig.conntrack_max): `add` raises
FlowTableFull instead of growing, so callers can refuse a new connection cleanly. Insert, lookup
and delete are O(1). The table also counts live flows per client address, TCP (`per_client`) and
UDP (`per_client_udp`), which FlowAdmission reads for its fair shares. A flow's owner may set `closer`, which ends the flow
(both legs reset) when the relay times it out, and `settle`, which the relay's next sweep runs once on a
flow still live then (set-up that short flows never need).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from usproxy.model.types import ServicePortName, format_hostport
from usproxy.util.rows import FlowRow

HostPort = tuple[str, int]

# TCP: NEW (accepted) -> SYN_SENT (dialing the endpoint) -> ESTABLISHED -> FIN_WAIT (one side sent
# FIN) -> CLOSING (both did). UDP: UNREPLIED until the endpoint's first reply, then ASSURED.
FlowState: TypeAlias = Literal["NEW", "SYN_SENT", "ESTABLISHED", "FIN_WAIT", "CLOSING", "UNREPLIED",
                               "ASSURED"]


class FlowTableFull(Exception):
    """The table holds `max_flows` flows; the new one was not added."""


@dataclass(slots=True, eq=False)
class Flow:
    """One relayed connection or UDP association. Mutable counters; identity by `id`."""

    protocol: str
    service: ServicePortName
    client: HostPort
    frontend: HostPort
    endpoint: HostPort | None = None
    local: HostPort | None = None
    local_of: Any = None  # a transport whose sockname is `local`, read only when shown
    closer: Callable[[], None] | None = None  # ends the flow (idle and half-close timeouts)
    liveness: Callable[[], float | None] | None = None  # seconds since either leg last got an ACK
    settle: Callable[[], None] | None = None  # set-up deferred to the relay's next sweep
    datapath: str = "userspace"
    state: FlowState = "NEW"
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    bytes_in: int = 0
    packets_in: int = 0
    bytes_out: int = 0
    packets_out: int = 0
    id: int = 0

    def seen_in(self, n: int) -> None:
        """Client → endpoint traffic (original direction)."""
        self.bytes_in += n
        self.packets_in += 1
        self.last_seen = time.monotonic()

    def seen_out(self, n: int) -> None:
        """Endpoint → client traffic (reply direction)."""
        self.bytes_out += n
        self.packets_out += 1
        self.last_seen = time.monotonic()

    def as_dict(self, now: float | None = None) -> FlowRow:
        now = time.monotonic() if now is None else now
        ep = format_hostport(*self.endpoint) if self.endpoint else "-"
        if self.local is None and self.local_of is not None:
            name = self.local_of.get_extra_info("sockname")
            self.local = (name[0], name[1]) if name else None
        local = format_hostport(*self.local) if self.local else "-"
        return {
            "id": self.id, "protocol": self.protocol, "state": self.state,
            "age": round(now - self.started, 3), "idle": round(now - self.last_seen, 3),
            "original": {"src": format_hostport(*self.client), "dst": format_hostport(*self.frontend)},
            "reply": {"src": ep, "dst": local},
            "packets_in": self.packets_in, "bytes_in": self.bytes_in,
            "packets_out": self.packets_out, "bytes_out": self.bytes_out,
            "datapath": self.datapath, "service": self.service.key(), "endpoint": ep,
        }


class FlowTable:
    """All live flows, bounded by `max_flows`."""

    def __init__(self, max_flows: int) -> None:
        self.max_flows = max_flows
        self._flows: dict[int, Flow] = {}
        self._ids = itertools.count(1)
        self.refused = 0
        self.refused_fair_share = 0  # of `refused`: a client over its fair share (FlowAdmission)
        self.timed_out = 0  # flows the relay reset for idling past their timeout
        # Counters read by the metrics collector at scrape time (nothing per flow reaches
        # Prometheus): flows opened and live per protocol, bytes of flows that ended.
        self.opened: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.per_client: dict[str, int] = {}  # client address -> live TCP flows
        self.per_client_udp: dict[str, int] = {}  # client address -> live UDP flows
        self.bytes_done = [0, 0]  # original (client -> endpoint), reply

    def add(self, flow: Flow) -> Flow:
        if len(self._flows) >= self.max_flows:
            self.refused += 1
            raise FlowTableFull(f"flow table full ({self.max_flows} flows)")
        flow.id = next(self._ids)
        self._flows[flow.id] = flow
        p = flow.protocol
        self.opened[p] = self.opened.get(p, 0) + 1
        self.live[p] = self.live.get(p, 0) + 1
        counts = self._per_client(p)
        if counts is not None:
            c = flow.client[0]
            counts[c] = counts.get(c, 0) + 1
        return flow

    def _per_client(self, protocol: str) -> dict[str, int] | None:
        return self.per_client if protocol == "TCP" else self.per_client_udp if protocol == "UDP" else None

    def remove(self, flow: Flow) -> None:
        if self._flows.pop(flow.id, None) is None:
            return
        self.live[flow.protocol] -= 1
        counts = self._per_client(flow.protocol)
        if counts is not None:
            c = flow.client[0]
            if counts[c] <= 1:
                del counts[c]
            else:
                counts[c] -= 1
        self.bytes_done[0] += flow.bytes_in
        self.bytes_done[1] += flow.bytes_out

    def __len__(self) -> int:
        return len(self._flows)

    def __iter__(self) -> Iterator[Flow]:
        return iter(list(self._flows.values()))

    def view(self) -> list[FlowRow]:
        now = time.monotonic()
        return [f.as_dict(now) for f in self._flows.values()]

    def view_chunks(self, size: int) -> Iterator[list[FlowRow]]:
        """The rows of `view()`, `size` at a time, from the flows live when iteration began: the
        caller may let the loop run between chunks (a flow that ends meanwhile is still shown,
        with its last counters)."""
        flows = list(self._flows.values())
        now = time.monotonic()
        for i in range(0, len(flows), size):
            yield [f.as_dict(now) for f in flows[i:i + size]]
