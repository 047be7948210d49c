"""EndpointsChangeTracker and EndpointsMap (as kube-proxy pkg/proxy/endpointschangetracker.go).

The tracker applies slice updates to an EndpointSliceCache and remembers, per Service, the slices
it had at the last checkout; if a Service's slices end up as they were, its pending pair is
dropped. Endpoints are merged only at checkout (as kube-proxy's endpointSliceCache
checkoutChanges): merging at every update cost each slice update the size of its whole Service
(100 slices of 1,000 endpoints: seconds for a relist). A Service whose slices changed but whose
merged endpoints did not (an endpoint moved between slices) is pending, as in kube-proxy, and
its pair compares equal at checkout. EndpointsMap applies checked-out changes and reports, per ServicePortName, the
endpoints that went away: the relay and the offload layer need them to clear stale UDP flows and
conntrack entries.

A checkout splits in three, so that a big one can be merged and compared off the event loop (one
ServicePort of 20,000 endpoints rewritten: ~0.1 s): `take()` (on the loop: the pending Services'
slices then and now, copies of values that are never changed, costing slices, not endpoints),
`endpoints_diff()` (pure: the merge and the comparison, safe in a worker thread), and
`EndpointsMap.apply()` (on the loop again: a dict update per changed ServicePortName).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from usproxy.model.endpoint import Endpoint
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.core.endpoint_slice_cache import EndpointsByPort, EndpointSliceCache, merged_slices
from usproxy.model.types import NamespacedName, ServicePortName

SlicesByName = dict[NamespacedName, EndpointSlice]
Taken = dict[NamespacedName, tuple[SlicesByName, SlicesByName]]  # per Service: slices then, now
EndpointsDiff = list[tuple[ServicePortName, tuple[Endpoint, ...], set[Endpoint]]]  # new (): removed; gone


class EndpointsChangeTracker:
    """Pending (previous, current) endpoints per Service since the last checkout."""

    def __init__(self) -> None:
        self.cache = EndpointSliceCache()
        self._previous: dict[NamespacedName, dict[NamespacedName, EndpointSlice]] = {}

    def update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> bool:
        """Record a slice add/update/delete; returns True when its Service has pending change."""
        es = current or previous
        if es is None:
            return False
        svc = es.service
        if previous is not None and current is not None and previous.service != current.service:
            self.update(previous, None)
            previous = None
        if svc not in self._previous:
            self._previous[svc] = self.cache.slices_of(svc)
        self.cache.apply(previous, current)
        if self.cache.slices_of(svc) == self._previous[svc]:
            del self._previous[svc]
            return False
        return True

    def pending(self) -> bool:
        return bool(self._previous)

    def pending_count(self) -> int:
        return len(self._previous)

    def take(self) -> Taken:
        """The pending Services' slices at the last checkout and now; nothing is pending after."""
        prev, self._previous = self._previous, {}
        return {svc: (before, self.cache.slices_of(svc)) for svc, before in prev.items()}

    def checkout(self) -> dict[NamespacedName, tuple[EndpointsByPort, EndpointsByPort]]:
        return merge_taken(self.take())


def merge_taken(taken: Mapping[NamespacedName, tuple[SlicesByName, SlicesByName]]
                ) -> dict[NamespacedName, tuple[EndpointsByPort, EndpointsByPort]]:
    """Per Service, its endpoints per ServicePortName then and now."""
    return {svc: (merged_slices(before), merged_slices(after)) for svc, (before, after) in taken.items()}


def endpoint_count(taken: Taken) -> int:
    """How many endpoints (per port) the slices of `taken` hold: the size of its merge."""
    return sum(len(eps) for pair in taken.values() for slices in pair for es in slices.values()
               for eps in es.endpoints.values())


def endpoints_diff(checked: Mapping[NamespacedName, tuple[EndpointsByPort, EndpointsByPort]]) -> EndpointsDiff:
    """The ServicePortNames whose endpoints changed: their new endpoints (() when none is left)
    and those of their old endpoints whose address and port went away."""
    out: EndpointsDiff = []
    for before, after in checked.values():
        for spn in before.keys() | after.keys():
            old, new = before.get(spn, ()), after.get(spn, ())
            if old == new:
                continue
            kept = {n.address for n in new}
            out.append((spn, new, {ep for ep in old if ep.address not in kept}))
    return out


@dataclass
class EndpointsMapChange:
    """What one EndpointsMap.update changed: ServicePortNames touched, endpoints gone per name."""

    updated: set[ServicePortName] = field(default_factory=set)
    removed: dict[ServicePortName, set[Endpoint]] = field(default_factory=dict)


class EndpointsMap(dict[ServicePortName, tuple[Endpoint, ...]]):
    """Endpoints of every ServicePortName, as of the last sync."""

    def update_from(self, tracker: EndpointsChangeTracker) -> EndpointsMapChange:
        return self.apply(endpoints_diff(tracker.checkout()))

    def apply(self, diff: EndpointsDiff) -> EndpointsMapChange:
        """Take the changes of `endpoints_diff`."""
        change = EndpointsMapChange()
        for spn, new, gone in diff:
            change.updated.add(spn)
            if gone:
                change.removed[spn] = gone
            if new:
                self[spn] = new
            else:
                self.pop(spn, None)
        return change
