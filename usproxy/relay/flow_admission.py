"""FlowAdmission: whether a new relayed flow may start, and what makes room for it.

The one place that holds the relay's flow bounds and its eviction policy; every TCP connection and
UDP flow of every ServicePort is admitted here (through its ServicePortRelay) before it is relayed.

Bounds, from the descriptor limit (`within`): a TCP flow holds two descriptors and a UDP flow one,
so the flow table (kube-proxy's conntrack max, ProxyConfig.conntrack_max) never holds more flows
than the limit less FD_RESERVE allows, and UDP flows are bounded by `max_udp` too. A connection
flood is then refused cleanly (RST) and never runs the agent out of descriptors (EMFILE would also
stop it reading manifests).

Policy: at a bound, the longest-idle UDP flow of any ServicePort is closed to make room (`evict_idle`,
the UDP relay's), so a UDP flood of fresh source ports cannot lock TCP out, and UDP, which has no
close to wait for, ages out first (C08). TCP connections are never evicted: a flow that still finds
the table full is refused with FlowTableFull.
"""

from __future__ import annotations

from collections.abc import Callable

from usproxy.conntrack.flow_table import Flow, FlowTable, HostPort
from usproxy.types import ServicePortName

FD_RESERVE = 256  # descriptors kept for listeners, TCP flows and the admin server
MIN_FLOWS = 16  # bounds never go below this, whatever the descriptor limit


class FlowAdmission:
    """The flow table's bounds and eviction policy; `table` is read by /flows and the metrics."""

    def __init__(self, table: FlowTable, max_udp: int, evict_idle: Callable[[], bool]) -> None:
        """`evict_idle()` closes the longest-idle UDP flow (which then calls `release`); it
        returns False when there is none."""
        self.table = table
        self.max_udp = max_udp
        self.evict_idle = evict_idle

    @classmethod
    def within(cls, conntrack_max: int, nofile: int, evict_idle: Callable[[], bool]) -> FlowAdmission:
        """Bounds for a process allowed `nofile` descriptors and a conntrack max of `conntrack_max`."""
        budget = max(MIN_FLOWS, nofile - min(FD_RESERVE, nofile // 4))
        table = FlowTable(min(conntrack_max, budget // 2))
        return cls(table, max(MIN_FLOWS, min(table.max_flows, budget)), evict_idle)

    def admit(self, protocol: str, service: ServicePortName, client: HostPort, frontend: HostPort) -> Flow:
        """A new flow in the table, after making room by the policy; raises FlowTableFull (and
        counts a refusal) when there is still none."""
        if protocol == "UDP" and self.table.live.get("UDP", 0) >= self.max_udp:
            self.evict_idle()
        if len(self.table) >= self.table.max_flows:
            self.evict_idle()
        return self.table.add(Flow(protocol, service, client, frontend))

    def release(self, flow: Flow) -> None:
        """The flow ended (idempotent)."""
        self.table.remove(flow)
