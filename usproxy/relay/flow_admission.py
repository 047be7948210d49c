"""FlowAdmission: whether a new relayed flow may start, and what makes room for it.

The one place that holds the relay's flow bounds and its eviction policy; every TCP connection and
UDP flow of every ServicePort is admitted here (through its ServicePortRelay) before it is relayed.

Bounds, from the descriptor limit (`within`): a TCP flow holds two descriptors and a UDP flow one,
so the flow table (kube-proxy's conntrack max, ProxyConfig.conntrack_max) never holds more flows
than the limit less FD_RESERVE allows, and UDP flows are bounded by `max_udp` too. A connection
flood is then refused cleanly (RST) and never runs the agent out of descriptors (EMFILE would also
stop it reading manifests).

Descriptor budget: every descriptor the relay holds counts against one budget, `descriptors` (the
limit less FD_RESERVE): each listener (the shared set of every listening socket, `listeners`) one,
each TCP flow two, each UDP flow one, and a spliced TCP flow's two pipes four more (`reserve_pipes`:
splicing is optional, so the pipes are refused, and the flow stays on the event loop, once the
budget is under pressure). A flow that would go over it is refused like a full table;
a listener that would go over it fails with EMFILE (`reserve_listener`) and is retried at the next
sync. FD_RESERVE is left for what the relay does not count: the admin servers (bounded by their
own connection limits), manifest reads, the API watch, libnftables and the event loop itself.

Policy: at a bound, the longest-idle UDP flow of any ServicePort is closed to make room (`evict_idle`,
the UDP relay's), so a UDP flood of fresh source ports cannot lock TCP out, and UDP, which has no
close to wait for, ages out first (C08). TCP connections are never evicted: a flow that still finds
the table full is refused with FlowTableFull.

Fair share (issue 18: one client's 9,872 idle connections to one Service got every other client of
every Service reset): while the table or the descriptor budget is under pressure (7/8 of its bound
or more), a new TCP connection from a client address that holds its fair share of the pressure mark
(the mark divided by the number of client addresses with live TCP flows) or more is refused; clients
below their share are still admitted up to the bound. UDP has the same share, counted over the
client addresses with live UDP flows (issue 29 item 9: one address sending 20,000 fresh-port
datagrams a second took the table, and the longest-idle flow of anyone, another client's live
session, was evicted again and again, moving it between endpoints): a new UDP flow from a client
at its share replaces that client's own longest-idle flow (`evict_own`), so a flooder churns its
own flows and never reaches the bound where other clients' flows are evicted. Recycling instead of
refusing keeps a busy resolver behind one address (a fresh source port per query) answered at
its share. No client is limited while there is no pressure (an ingress controller or a NATed
network is one address with many legitimate connections).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sized

from usproxy.flows.flow_table import Flow, FlowTable, FlowTableFull, HostPort
from usproxy.relay.tcp_splice import PIPE_FDS
from usproxy.model.types import ServicePortName

FD_RESERVE = 256  # descriptors kept for the admin servers, manifest reads, the API watch, libnftables
MIN_FLOWS = 16  # bounds never go below this, whatever the descriptor limit
PRESSURE = 7 / 8  # share of a bound above which the fair share applies


class FlowAdmission:
    """The flow table's bounds and eviction policy; `table` is read by /flows and the metrics."""

    def __init__(self, table: FlowTable, max_udp: int, evict_idle: Callable[[], bool], *,
                 descriptors: int | None = None, listeners: Sized = (),
                 evict_own: Callable[[str], bool] = lambda client: False) -> None:
        """`evict_idle()` closes the longest-idle UDP flow (which then calls `release`); it
        returns False when there is none; `evict_own(client address)` the same among that
        client's UDP flows. `descriptors` is the budget (None: unbounded), `listeners` the live
        set of listening sockets (its length is read at each admission)."""
        self.table = table
        self.max_udp = max_udp
        self.evict_idle = evict_idle
        self.evict_own = evict_own
        self.descriptors = descriptors
        self.listeners = listeners
        self.pipe_fds = 0  # descriptors of the spliced TCP flows' pipes

    @classmethod
    def within(cls, conntrack_max: int, nofile: int, evict_idle: Callable[[], bool],
               listeners: Sized = (), evict_own: Callable[[str], bool] = lambda client: False) -> FlowAdmission:
        """Bounds for a process allowed `nofile` descriptors and a conntrack max of `conntrack_max`
        (0: none of its own, as kube-proxy leaves the kernel's limit alone when its rule gives 0;
        the descriptor budget still bounds the table)."""
        budget = max(MIN_FLOWS, nofile - min(FD_RESERVE, nofile // 4))
        table = FlowTable(min(conntrack_max, budget // 2) if conntrack_max > 0 else budget // 2)
        return cls(table, max(MIN_FLOWS, min(table.max_flows, budget)), evict_idle,
                   descriptors=budget, listeners=listeners, evict_own=evict_own)

    def descriptors_held(self) -> int:
        """Descriptors the relay holds now: one per listener and UDP flow, two per TCP flow, four
        per spliced TCP flow's pipes."""
        live = self.table.live  # (no generator: this runs for most new connections)
        return len(self.listeners) + sum(live.values()) + live.get("TCP", 0) + self.pipe_fds

    def _over_budget(self, need: int) -> bool:
        return self.descriptors is not None and self.descriptors_held() + need > self.descriptors

    def reserve_listener(self) -> None:
        """Raises OSError(EMFILE) when one more listener would go over the descriptor budget
        (the caller reports it as a failed listen and retries later)."""
        if self._over_budget(1):
            self.evict_idle()
        if self._over_budget(1):
            raise OSError(errno.EMFILE, f"descriptor budget of {self.descriptors} reached")

    def admit(self, protocol: str, service: ServicePortName, client: HostPort, frontend: HostPort) -> Flow:
        """A new flow in the table, after making room by the policy; raises FlowTableFull (and
        counts a refusal) when there is still none. A client over its fair share is refused
        before anything is evicted for it."""
        need = 2 if protocol == "TCP" else 1
        if protocol == "TCP" and self._over_fair_share(client[0], need):
            self.table.refused += 1
            self.table.refused_fair_share += 1
            raise FlowTableFull(f"client {client[0]} holds its fair share of the flow table")
        if protocol == "UDP" and self._over_udp_share(client[0]):
            self.evict_own(client[0])  # its own longest-idle flow makes room; nobody else's
        if protocol == "UDP" and self.table.live.get("UDP", 0) >= self.max_udp:
            self.evict_idle()
        if len(self.table) >= self.table.max_flows:
            self.evict_idle()
        if self._over_budget(need) and not (self.evict_idle() and not self._over_budget(need)):
            self.table.refused += 1
            raise FlowTableFull(f"descriptor budget of {self.descriptors} reached")
        return self.table.add(Flow(protocol, service, client, frontend))

    def _over_fair_share(self, client_ip: str, need: int) -> bool:
        """Under pressure, does `client_ip` hold its fair share (see the module docstring)? A
        client with no TCP flow never does: checked first, so the common case costs one lookup
        (no count of descriptors on the per-connection path)."""
        held = self.table.per_client.get(client_ip, 0)
        if not held:
            return False
        mark = int(self.table.max_flows * PRESSURE)
        pressed = len(self.table) >= mark
        if not pressed and self.descriptors is not None:
            pressed = self.descriptors_held() + need > self.descriptors * PRESSURE
            mark = min(mark, int(self.descriptors * PRESSURE) // 2)  # in flows: two descriptors each
        return pressed and held >= max(1, mark // len(self.table.per_client))

    def _over_udp_share(self, client_ip: str) -> bool:
        """TCP's fair share for UDP: under pressure (UDP flows, the table or the descriptor budget
        at 7/8 of its bound), does `client_ip` hold the UDP mark divided by the number of client
        addresses with UDP flows? A client without a UDP flow never does (one lookup)."""
        held = self.table.per_client_udp.get(client_ip, 0)
        if not held:
            return False
        mark = int(min(self.max_udp, self.table.max_flows) * PRESSURE)
        pressed = self.table.live.get("UDP", 0) >= mark or len(self.table) >= int(self.table.max_flows * PRESSURE)
        if self.descriptors is not None:
            pressed = pressed or self.descriptors_held() + 1 > self.descriptors * PRESSURE
            mark = min(mark, int(self.descriptors * PRESSURE))  # one descriptor per UDP flow
        return pressed and held >= max(1, mark // len(self.table.per_client_udp))

    def reserve_pipes(self) -> bool:
        """Count a spliced flow's pipes (PIPE_FDS descriptors), unless that takes the budget to
        its pressure mark (PRESSURE of it): False then, and nothing counted."""
        if self.descriptors is not None and self.descriptors_held() + PIPE_FDS > self.descriptors * PRESSURE:
            return False
        self.pipe_fds += PIPE_FDS
        return True

    def release_pipes(self) -> None:
        """Give back one `reserve_pipes` that returned True."""
        self.pipe_fds -= PIPE_FDS

    def release(self, flow: Flow) -> None:
        """The flow ended (idempotent)."""
        self.table.remove(flow)
