"""KernelDatapath: the interface nftables and BPF offload implement.

A kernel datapath holds, per offloaded ServicePort, its frontends (ClusterIPs, NodePorts,
external IPs, as far as it serves that traffic kind) and the endpoints to pick from. `apply` is one
atomic transaction: it either installs all the given changes or raises OffloadError and changes
nothing. `read_back` returns what the kernel holds now (after an agent restart, to reconcile as a
diff instead of rebuilding from empty, field case C20).

What only some datapaths offer (NodeAddressFollower, ExternalServing, ServiceCIDRHandler, ...) is
declared in one place, usproxy/core/datapath.py, next to the Datapath interface. Each kernel
datapath declares which of them it implements in its KernelDatapathDeclaration, the record
usproxy/offload/registry.py lists: a test holds every built datapath to its declaration.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.datapath_name import KernelDatapathName
from usproxy.model.service_port import LBPolicy
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.util.rows import FlowRow

if TYPE_CHECKING:
    from usproxy.model.config import ProxyConfig
    from usproxy.model.node import NodeFacts
    from usproxy.offload.settings import OffloadSettings
    from usproxy.util.locks import NetnsLock

TrafficKind = Literal["local", "forwarded"]
"""local: connections made by processes on this node; forwarded: packets routed through it."""
ALL_TRAFFIC: frozenset[TrafficKind] = frozenset({"local", "forwarded"})


@dataclass(frozen=True, slots=True)
class Capability:
    """Whether a kernel feature is usable here, and the evidence (`detail`)."""

    name: str
    available: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "available": self.available, "detail": self.detail}


class KernelDatapath(Protocol):
    """What every kernel offload datapath implements (and its fake, for unit tests)."""

    name: str
    traffic: frozenset[TrafficKind]

    def probe(self) -> Capability:
        """Can this node run the datapath? Never raises."""

    def unsupported(self, state: ServicePortState) -> str | None:
        """Why this ServicePort cannot be offloaded here (e.g. SCTP), or None."""

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """Install (state) or remove (None) ServicePorts in one transaction. Raises OffloadError."""

    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        """The ServicePorts installed in the kernel now, with their endpoints."""

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        """Delete kernel conntrack entries of UDP flows to endpoints that went away."""

    def flows_view(self) -> list[FlowRow]:
        """Kernel flows of offloaded ServicePorts, in the /flows row format."""

    def dump(self) -> str:
        """Stable text of what is installed (for tests and explain --live)."""

    async def cleanup(self) -> None:
        """Remove everything this datapath ever installed (`usproxy run --cleanup`)."""

    def close(self) -> None:
        """Release this process's threads and descriptors; what is installed stays (C20)."""


# -- the declaration a kernel datapath gives the registry -----------------------------------------
@dataclass(frozen=True, slots=True)
class BuildContext:
    """What building a kernel datapath may use: the offload settings, this node's facts, the
    node's addresses now (the relay's, for loadBalancerSourceRanges) and the network namespace
    (None: this process's)."""

    settings: OffloadSettings
    node: NodeFacts
    node_ips: Callable[[], Sequence[IPAddress]] = tuple
    netns: str | None = None


@dataclass(frozen=True, slots=True)
class KernelDatapathDeclaration:
    """One kernel datapath as the agent, the CLI, `--cleanup` and `usproxy check` know it.

    Every callable imports the datapath's code only when called, so reading the registry loads no
    libbpf or libnftables. `build` may leave out a datapath `--offload` asks for only by name
    (returns None); `remove` deletes everything it ever installed (raises on failure);
    `leftovers` names what an earlier run left without changing anything; `lock` is a lock an
    agent running it holds beyond its network namespace's (BPF: the node-wide pin root); a
    datapath it `conflicts` with is left out of the ladder where this one is usable."""

    name: KernelDatapathName
    summary: str  # one line: what it is, for --help and `usproxy check`
    serves: frozenset[TrafficKind]  # the traffic it can carry at best
    lb_policies: frozenset[LBPolicy]  # the usproxy.io/lb-policy values it serves; others stay in the relay
    build: Callable[[BuildContext], KernelDatapath | None]
    probes: Callable[[ProxyConfig], list[Capability]]
    leftovers: Callable[[ProxyConfig], Awaitable[list[str]]]
    remove: Callable[[ProxyConfig], Awaitable[None]]
    lock: Callable[[ProxyConfig], NetnsLock] | None = None
    optional: tuple[type, ...] = field(default=())  # the optional protocols its datapath implements
    # datapaths whose kernel state collides with this one's (kube-proxy's iptables and IPVS modes
    # name chains alike): an agent uses this one only where none of them is usable
    conflicts: tuple[str, ...] = ()

    def policy_gap(self, policy: LBPolicy) -> str | None:
        """Why this datapath cannot serve `policy`, or None (placement checks membership)."""
        if policy in self.lb_policies:
            return None
        return f"lb-policy {policy} is not served by {self.name} (it serves {', '.join(sorted(self.lb_policies))})"
