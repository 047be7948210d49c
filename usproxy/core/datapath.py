"""The datapath interface: what the Proxier hands to the relay and to kernel offload.

A sync hands each datapath only the ServicePorts that changed, each as a ServicePortState (or
None: the ServicePort is gone), plus the endpoints that went away per ServicePort, so stale UDP
flows and conntrack entries can be cleared. A full resync hands every ServicePort. Datapaths keep
their own installed view and touch only what differs. `FakeDatapath` records state and renders
`dump()` text for unit tests.

What only some datapaths offer is declared as Protocols the agent checks with isinstance:
FlowsView (rows for /flows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName, format_hostport


@dataclass(frozen=True, slots=True)
class ServicePortState:
    """One ServicePort with its endpoints, after traffic policies (see endpoint.categorize).

    `cluster_endpoints` serve traffic to ClusterIPs; `external_endpoints` serve NodePorts,
    externalIPs and LoadBalancer IPs. Either may be empty: then that traffic must be refused.
    `short_circuit_endpoints` (externalTrafficPolicy Local only) serve traffic from pods and from
    the node itself to the external addresses: every endpoint of the Cluster policy, as
    kube-proxy's "short-circuit" rules (pkg/proxy/nftables/proxier.go, external traffic chain).
    """

    service_port: ServicePort
    endpoints: tuple[Endpoint, ...]
    cluster_endpoints: tuple[Endpoint, ...]
    external_endpoints: tuple[Endpoint, ...]
    short_circuit_endpoints: tuple[Endpoint, ...] = ()


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


@runtime_checkable
class FlowsView(Protocol):
    """A datapath that lists the flows it carries for /flows (the relay's flow table, kernel
    conntrack entries of offloaded ServicePorts)."""

    flows_block: bool  # True: listing dumps kernel state, so the agent calls it in a worker thread

    def flows_view(self) -> list[dict[str, Any]]:
        """One dict per flow, in the /flows row format."""


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
