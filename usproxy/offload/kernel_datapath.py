"""KernelDatapath: the interface nftables and BPF offload implement.

A kernel datapath holds, per offloaded ServicePort, its frontends (ClusterIPs, NodePorts,
external IPs, as far as it serves that traffic kind) and the endpoints to pick from. `apply` is one
atomic transaction: it either installs all the given changes or raises OffloadError and changes
nothing. `read_back` returns what the kernel holds now (after an agent restart, to reconcile as a
diff instead of rebuilding from empty, field case C20).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import ServicePortName

TrafficKind = Literal["local", "forwarded"]
"""local: connections made by processes on this node; forwarded: packets routed through it."""


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

    def flows_view(self) -> list[dict[str, Any]]:
        """Kernel flows of offloaded ServicePorts, in the /flows row format."""

    def dump(self) -> str:
        """Stable text of what is installed (for tests and explain --live)."""

    async def cleanup(self) -> None:
        """Remove everything this datapath ever installed (`usproxy run --cleanup`)."""

    def close(self) -> None:
        """Release this process's threads and descriptors; what is installed stays (C20)."""


@runtime_checkable
class NodeAddressFollower(Protocol):
    """A kernel datapath that reads the node's addresses itself and must read them again when the
    NodePort addresses change (BPF's tc programs: usp_tc_addrs); the agent awaits it before the
    full sync that change asks for."""

    async def node_addresses_changed(self) -> None: ...
