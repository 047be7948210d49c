"""Sources of Services and EndpointSlices: static manifests and the Kubernetes API.

Both deliver parsed objects to a Provider (the Proxier), as kube-proxy's config handlers do.
What only some sources know (whether this Node is being deleted), or only some Providers can do
(hold their syncs), is a Protocol of its own checked with isinstance.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.model.service import Service


class Provider(Protocol):
    """What a source feeds (as kube-proxy pkg/proxy/types.go Provider)."""

    def on_service_update(self, previous: Service | None, current: Service | None) -> None: ...

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None: ...

    def on_services_synced(self) -> None: ...

    def on_endpoint_slices_synced(self) -> None: ...


class Source(Protocol):
    """What the agent runs: a source feeding its Provider until cancelled."""

    async def run(self) -> None: ...


@runtime_checkable
class SyncHolder(Protocol):
    """A Provider that can hold its syncs while a source applies a relist in chunks (the loop
    runs between chunks), so no sync sees a list half-applied (Proxier.hold_syncs)."""

    def hold_syncs(self) -> AbstractContextManager[None]: ...


def hold_syncs(provider: object) -> AbstractContextManager[None]:
    """`provider`'s sync hold, or a hold that does nothing for a Provider without one."""
    return provider.hold_syncs() if isinstance(provider, SyncHolder) else nullcontext()


@runtime_checkable
class NodeEligibility(Protocol):
    """A source that follows this Node: False while it is being deleted (kube-proxy's
    ProxierHealthServer nodeEligible, which fails /healthz so load balancers drain the node)."""

    @property
    def node_eligible(self) -> bool: ...
