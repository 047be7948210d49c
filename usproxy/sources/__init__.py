"""Sources of Services and EndpointSlices: static manifests and the Kubernetes API.

Both deliver parsed objects to a Provider (the Proxier), as kube-proxy's config handlers do.
"""

from __future__ import annotations

from typing import Protocol

from usproxy.endpoint_slice import EndpointSlice
from usproxy.service import Service


class Provider(Protocol):
    """What a source feeds (as kube-proxy pkg/proxy/types.go Provider)."""

    def on_service_update(self, previous: Service | None, current: Service | None) -> None: ...

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None: ...

    def on_services_synced(self) -> None: ...

    def on_endpoint_slices_synced(self) -> None: ...
