"""ServiceChangeTracker and ServicePortMap (as kube-proxy pkg/proxy/servicechangetracker.go).

The tracker keeps, per Service, the ServicePorts it had at the last sync (`previous`) and what it
has now (`current`); a pair that ends up equal is dropped, so a sync only sees real change. Add
is `update(None, svc)`, delete is `update(svc, None)`. ServicePortMap applies checked-out changes
and says which ServicePortNames were added, updated or removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from usproxy.model.service import Service
from usproxy.model.service_port import ServicePort
from usproxy.model.types import NamespacedName, ServicePortName

PortMap = Mapping[ServicePortName, ServicePort]


class ServiceChangeTracker:
    """Pending (previous, current) ServicePorts per Service since the last checkout."""

    def __init__(self) -> None:
        self._items: dict[NamespacedName, tuple[PortMap, PortMap]] = {}

    def update(self, previous: Service | None, current: Service | None) -> bool:
        """Record a change; returns True when something is pending for that Service."""
        svc = (current or previous)
        if svc is None:
            return False
        name = svc.name
        before = self._items[name][0] if name in self._items else (previous.ports if previous else {})
        after: PortMap = current.ports if current else {}
        if dict(before) == dict(after):
            self._items.pop(name, None)
            return False
        self._items[name] = (before, after)
        return True

    def pending(self) -> bool:
        return bool(self._items)

    def pending_count(self) -> int:
        return len(self._items)

    def checkout(self) -> dict[NamespacedName, tuple[PortMap, PortMap]]:
        items, self._items = self._items, {}
        return items


@dataclass
class ServiceMapChange:
    """What one ServicePortMap.update changed."""

    added: set[ServicePortName] = field(default_factory=set)
    updated: set[ServicePortName] = field(default_factory=set)
    removed: dict[ServicePortName, ServicePort] = field(default_factory=dict)

    @property
    def changed(self) -> set[ServicePortName]:
        return self.added | self.updated | set(self.removed)


class ServicePortMap(dict[ServicePortName, ServicePort]):
    """The ServicePorts of every Service, as of the last sync."""

    def update_from(self, tracker: ServiceChangeTracker) -> ServiceMapChange:
        change = ServiceMapChange()
        for previous, current in tracker.checkout().values():
            for spn, sp in previous.items():
                if spn not in current:
                    change.removed[spn] = sp
                    self.pop(spn, None)
            for spn, sp in current.items():
                (change.updated if spn in previous else change.added).add(spn)
                self[spn] = sp
        return change
