"""EndpointsChangeTracker and EndpointsMap (as kube-proxy pkg/proxy/endpointschangetracker.go).

The tracker applies slice updates to an EndpointSliceCache and remembers, per Service, the merged
endpoints it had at the last checkout; if a Service's endpoints end up as they were, its pending
pair is dropped. EndpointsMap applies checked-out changes and reports, per ServicePortName, the
endpoints that went away: the relay and the offload layer need them to clear stale UDP flows and
conntrack entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from usproxy.endpoint import Endpoint
from usproxy.endpoint_slice import EndpointSlice
from usproxy.endpoint_slice_cache import EndpointsByPort, EndpointSliceCache
from usproxy.types import NamespacedName, ServicePortName


class EndpointsChangeTracker:
    """Pending (previous, current) endpoints per Service since the last checkout."""

    def __init__(self) -> None:
        self.cache = EndpointSliceCache()
        self._previous: dict[NamespacedName, EndpointsByPort] = {}

    def update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> bool:
        """Record a slice add/update/delete; returns True when its Service has pending change."""
        es = current or previous
        if es is None:
            return False
        svc = es.service
        if previous is not None and current is not None and previous.service != current.service:
            self.update(previous, None)
            previous = None
        self._previous.setdefault(svc, self.cache.endpoints_for(svc))
        self.cache.apply(previous, current)
        if self.cache.endpoints_for(svc) == self._previous[svc]:
            del self._previous[svc]
            return False
        return True

    def pending(self) -> bool:
        return bool(self._previous)

    def pending_count(self) -> int:
        return len(self._previous)

    def checkout(self) -> dict[NamespacedName, tuple[EndpointsByPort, EndpointsByPort]]:
        prev, self._previous = self._previous, {}
        return {svc: (before, self.cache.endpoints_for(svc)) for svc, before in prev.items()}


@dataclass
class EndpointsMapChange:
    """What one EndpointsMap.update changed: ServicePortNames touched, endpoints gone per name."""

    updated: set[ServicePortName] = field(default_factory=set)
    removed: dict[ServicePortName, set[Endpoint]] = field(default_factory=dict)


class EndpointsMap(dict[ServicePortName, tuple[Endpoint, ...]]):
    """Endpoints of every ServicePortName, as of the last sync."""

    def update_from(self, tracker: EndpointsChangeTracker) -> EndpointsMapChange:
        change = EndpointsMapChange()
        for before, after in tracker.checkout().values():
            for spn in before.keys() | after.keys():
                old, new = before.get(spn, ()), after.get(spn, ())
                if old == new:
                    continue
                change.updated.add(spn)
                if old:
                    kept = {n.address for n in new}
                    gone = {ep for ep in old if ep.address not in kept}
                    if gone:
                        change.removed[spn] = gone
                if new:
                    self[spn] = new
                else:
                    self.pop(spn, None)
        return change
