"""The datapath interface: what the Proxier hands to the relay and to kernel offload.

A sync hands each datapath only the ServicePorts that changed, each as a ServicePortState (or
None: the ServicePort is gone), plus the endpoints that went away per ServicePort, so stale UDP
flows and conntrack entries can be cleared. A full resync hands every ServicePort. Datapaths keep
their own installed view and touch only what differs. `FakeDatapath` records state and renders
`dump()` text for unit tests.

What only some datapaths offer is declared here, next to Datapath, as Protocols their callers
check with isinstance, each saying who calls it: FlowsView and ChunkedFlowsView (/flows),
ExternalView (/services' external route), ServiceCIDRHandler (the cluster's Service CIDRs), and
four that kernel datapaths (usproxy/offload/kernel_datapath.py) offer the offload manager and
the agent: NodeAddressFollower, ExternalServing, UdpConntrackReconciler and KernelWriteCounter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port_state import ServicePortState as ServicePortState  # what every datapath gets
from usproxy.model.types import IPNetwork, ServicePortName, format_hostport
from usproxy.util.rows import FlowRow

if TYPE_CHECKING:
    from usproxy.core.stale_udp import StaleUdp


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """The changes of one sync. `changes[spn] is None` means the ServicePort was removed."""

    changes: Mapping[ServicePortName, ServicePortState | None]
    removed_endpoints: Mapping[ServicePortName, frozenset[Endpoint]] = field(default_factory=dict)
    full: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    """Which datapath serves a ServicePort, and why (shown in /services and `usproxy status`).

    `error` marks a reason that says the datapath fails to serve it as asked (a relay listener
    that cannot bind): no later datapath's note about the same datapath hides it."""

    datapath: str
    reason: str
    error: bool = False


class Datapath(Protocol):
    """What every datapath (relay, nftables, bpf, fakes) implements."""

    name: str

    async def sync(self, request: SyncRequest) -> None:
        """Apply one sync. Raises on failure; the Proxier logs and retries."""

    def placement(self, spn: ServicePortName) -> Placement | None:
        """How this datapath serves `spn`, or None when it does not."""

    def dump(self) -> str:
        """Stable text of the installed state, for tests and `usproxy explain --live`."""

    async def close(self) -> None:
        """Release what this datapath holds (on agent shutdown)."""


# -- optional protocols: what only some datapaths offer ------------------------------------------
@runtime_checkable
class FlowsView(Protocol):
    """Called by the agent for /flows: the flows a datapath carries (the relay's flow table,
    kernel conntrack entries of offloaded ServicePorts)."""

    flows_block: bool  # True: listing dumps kernel state, so the agent calls it in a worker thread

    def flows_view(self) -> list[FlowRow]:
        """One dict per flow, in the /flows row format."""


@runtime_checkable
class ChunkedFlowsView(Protocol):
    """Called by the agent for /flows instead of FlowsView when the flows live on the loop (the
    relay): `flows_chunks(n)` yields lists of at most n rows from a snapshot of its table."""

    def flows_chunks(self, size: int) -> Iterator[list[FlowRow]]: ...


@runtime_checkable
class ExternalView(Protocol):
    """Called by the agent for /services' external route of a ServicePort (the offload manager:
    which datapath serves its traffic from outside the node, and why)."""

    def external_placement(self, spn: ServicePortName) -> Placement | None: ...


@runtime_checkable
class ServiceCIDRHandler(Protocol):
    """Called by the sources (on the Proxier) and by the Proxier and the offload manager (on
    datapaths) with the cluster's Service CIDRs (kube-proxy's ServiceCIDRHandler): the complete,
    collapsed set after each change, both families."""

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None: ...


@runtime_checkable
class NodeAddressFollower(Protocol):
    """Called by the agent when the NodePort addresses change, before the full sync that change
    asks for: a kernel datapath that reads the node's addresses itself reads them again (BPF's
    tc programs: usp_tc_addrs)."""

    async def node_addresses_changed(self) -> None: ...


@runtime_checkable
class UdpConntrackReconciler(Protocol):
    """Called by the offload manager (usproxy/offload/stale_cleanup.py) on a kernel datapath whose
    UDP Services leave DNATed kernel conntrack entries (nftables; an iptables datapath too): the
    stale-entry rule of every UDP ServicePort (usproxy/core/stale_udp.py) after each full sync,
    and of the changed ones after other syncs, instead of the removed endpoints (`clear_stale`)."""

    async def reconcile_udp(self, rule: StaleUdp) -> None: ...


@runtime_checkable
class ExternalServing(Protocol):
    """Called by the offload manager (usproxy/offload/external_route.py) for /services: how this
    kernel datapath serves a ServicePort's traffic from outside the node (BpfDatapath: a Placement
    whose datapath is its own path, "tc", or "relay" with the reason it leaves the traffic there)."""

    def external_route(self, state: ServicePortState) -> Placement: ...


@runtime_checkable
class KernelWriteCounter(Protocol):
    """Read by the offload manager's metric usproxy_kernel_writes_total (and through it by
    `usproxy tour`): what this kernel datapath has sent to the kernel since it was built,
    counted in its own unit, `write_unit`: lines of iptables-restore input (iptables),
    operations of its nftables transactions (an element, rule, chain, map, set or table added or
    deleted, a chain flushed: nftables), BPF map elements written or deleted (bpf)."""

    write_unit: str

    def kernel_writes(self) -> int: ...


class FakeDatapath:
    """Records synced state; `fail_next` makes the next sync raise (to test retries) and
    `errors[spn]` is reported as its placement error."""

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.state: dict[ServicePortName, ServicePortState] = {}
        self.syncs: list[SyncRequest] = []
        self.fail_next = 0
        self.errors: dict[ServicePortName, str] = {}

    async def sync(self, request: SyncRequest) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected sync failure")
        self.syncs.append(request)
        for spn, st in request.changes.items():
            if st is None:
                self.state.pop(spn, None)
            else:
                self.state[spn] = st

    def placement(self, spn: ServicePortName) -> Placement | None:
        if spn not in self.state:
            return None
        error = self.errors.get(spn)
        return Placement(self.name, error, error=True) if error is not None else Placement(self.name, "fake")

    def dump(self) -> str:
        lines = []
        for spn in sorted(self.state):
            st = self.state[spn]
            eps = " ".join(str(ep) for ep in st.cluster_endpoints) or "<none>"
            front = format_hostport(st.service_port.cluster_ip, st.service_port.port)
            lines.append(f"{spn.key()} {front} -> {eps}")
        return "\n".join(lines)

    async def close(self) -> None:
        self.state.clear()
