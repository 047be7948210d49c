"""EndpointSliceCache: the slices of every Service, merged into endpoints per ServicePortName.

As kube-proxy pkg/proxy/endpointslicecache.go: a Service may have many slices; the same address
and port may appear in more than one (during a slice rewrite), and then counts once, preferring
the entry that is ready. Endpoints come out sorted, so equal sets compare equal.
"""

from __future__ import annotations

from collections.abc import Mapping

from usproxy.model.endpoint import Endpoint, merged
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.model.types import NamespacedName, ServicePortName

EndpointsByPort = dict[ServicePortName, tuple[Endpoint, ...]]


class EndpointSliceCache:
    """Current slices per Service, by slice name."""

    def __init__(self) -> None:
        self._slices: dict[NamespacedName, dict[NamespacedName, EndpointSlice]] = {}

    def apply(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None:
        if previous is not None:
            self._slices.get(previous.service, {}).pop(previous.name, None)
            if not self._slices.get(previous.service):
                self._slices.pop(previous.service, None)
        if current is not None:
            self._slices.setdefault(current.service, {})[current.name] = current

    def slices_of(self, service: NamespacedName) -> dict[NamespacedName, EndpointSlice]:
        """A copy of `service`'s slices by slice name (costs the number of slices, not endpoints)."""
        return dict(self._slices.get(service, {}))

    def endpoints_for(self, service: NamespacedName) -> EndpointsByPort:
        return merged_slices(self._slices.get(service, {}))


def merged_slices(slices: Mapping[NamespacedName, EndpointSlice]) -> EndpointsByPort:
    """The endpoints per ServicePortName of one Service's `slices`, merged."""
    if len(slices) == 1:  # the common case: a slice's endpoints are merged when it is parsed
        (only,) = slices.values()
        return dict(only.endpoints)
    groups: dict[ServicePortName, list[tuple[Endpoint, ...]]] = {}
    for es in slices.values():
        for spn, eps in es.endpoints.items():
            groups.setdefault(spn, []).append(eps)
    return {spn: merged(g) for spn, g in groups.items()}
