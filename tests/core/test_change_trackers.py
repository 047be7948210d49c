"""ServiceChangeTracker / ServicePortMap and EndpointsChangeTracker / EndpointsMap, table-driven:
unchanged pairs are dropped, add/update/delete are reported per ServicePortName, and removed
endpoints are listed per ServicePort."""

from __future__ import annotations

import ipaddress

import pytest

from usproxy.model.endpoint import Endpoint
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.core.endpoints_change_tracker import EndpointsChangeTracker, EndpointsMap
from usproxy.model.service import Service
from usproxy.core.service_change_tracker import ServiceChangeTracker, ServicePortMap
from usproxy.model.service_port import ServicePort
from usproxy.model.types import NamespacedName, ServicePortName

NN = NamespacedName("default", "web")
HTTP = ServicePortName("default", "web", "http", "TCP")
DNS = ServicePortName("default", "web", "dns", "UDP")


def service(*ports: tuple[ServicePortName, int]) -> Service:
    ip = ipaddress.ip_address("10.96.0.1")
    return Service(NN, {spn: ServicePort(spn, (ip,), port, port) for spn, port in ports})


def es(name: str, spn: ServicePortName, *ips: str, ready: bool = True) -> EndpointSlice:
    eps = tuple(Endpoint(ipaddress.ip_address(ip), 8080, ready=ready) for ip in ips)
    return EndpointSlice(NamespacedName("default", name), NN, "IPv4", {spn: eps})


SERVICE_CASES = [
    ("add", [(None, service((HTTP, 80)))], {"added": {HTTP}}),
    ("add then delete cancels", [(None, service((HTTP, 80))), (service((HTTP, 80)), None)], {}),
    ("unchanged update dropped", [(service((HTTP, 80)), service((HTTP, 80)))], {}),
    ("port change", [(service((HTTP, 80)), service((HTTP, 81)))], {"updated": {HTTP}}),
    ("port added and removed", [(service((HTTP, 80)), service((DNS, 53)))], {"added": {DNS}, "removed": {HTTP}}),
]


@pytest.mark.parametrize("name,updates,expected", SERVICE_CASES, ids=[c[0] for c in SERVICE_CASES])
def test_service_changes(name: str, updates: list[tuple[Service | None, Service | None]], expected: dict[str, set[ServicePortName]]) -> None:
    tracker, spm = ServiceChangeTracker(), ServicePortMap()
    first = updates[0][0]
    if first is not None:  # the map starts with the "previous" state already synced
        tracker.update(None, first)
        spm.update_from(tracker)
    for prev, cur in updates:
        tracker.update(prev, cur)
    change = spm.update_from(tracker)
    assert change.added == expected.get("added", set())
    assert change.updated == expected.get("updated", set())
    assert set(change.removed) == expected.get("removed", set())
    assert not tracker.pending()


def test_endpoint_slice_add_update_delete_reports_removed_endpoints() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    a = es("web-1", HTTP, "10.244.1.1", "10.244.2.2")
    assert tracker.update(None, a)
    change = em.update_from(tracker)
    assert change.updated == {HTTP} and change.removed == {}
    b = es("web-1", HTTP, "10.244.1.1")
    tracker.update(a, b)
    change = em.update_from(tracker)
    assert {str(e.ip) for e in change.removed[HTTP]} == {"10.244.2.2"}
    tracker.update(b, None)
    change = em.update_from(tracker)
    assert HTTP not in em and {str(e.ip) for e in change.removed[HTTP]} == {"10.244.1.1"}


def test_slice_flap_back_to_original_is_dropped() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    a = es("web-1", HTTP, "10.244.1.1")
    tracker.update(None, a)
    em.update_from(tracker)
    b = es("web-1", HTTP, "10.244.1.1", ready=False)
    tracker.update(a, b)
    assert not tracker.update(b, a)  # back where the last sync left it: nothing pending
    assert em.update_from(tracker).updated == set()


def test_two_slices_merge_and_duplicates_prefer_ready() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    tracker.update(None, es("web-1", HTTP, "10.244.1.1", ready=False))
    tracker.update(None, es("web-2", HTTP, "10.244.1.1", "10.244.3.3"))
    em.update_from(tracker)
    assert [(str(e.ip), e.ready) for e in em[HTTP]] == [("10.244.1.1", True), ("10.244.3.3", True)]


def test_condition_change_is_an_update_without_removal() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    a = es("web-1", HTTP, "10.244.1.1")
    tracker.update(None, a)
    em.update_from(tracker)
    tracker.update(a, es("web-1", HTTP, "10.244.1.1", ready=False))
    change = em.update_from(tracker)
    assert change.updated == {HTTP} and change.removed == {}


def test_one_slice_listing_an_address_twice_counts_it_once_ready_first() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    eps = (Endpoint(ipaddress.ip_address("10.244.3.3"), 8080),
           Endpoint(ipaddress.ip_address("10.244.1.1"), 8080, ready=False),
           Endpoint(ipaddress.ip_address("10.244.1.1"), 8080))
    tracker.update(None, EndpointSlice(NamespacedName("default", "web-1"), NN, "IPv4", {HTTP: eps}))
    em.update_from(tracker)
    assert [(str(e.ip), e.ready) for e in em[HTTP]] == [("10.244.1.1", True), ("10.244.3.3", True)]


def test_endpoint_moved_between_slices_is_pending_but_changes_nothing() -> None:
    tracker, em = EndpointsChangeTracker(), EndpointsMap()
    a, b = es("web-1", HTTP, "10.244.1.1", "10.244.2.2"), es("web-2", HTTP, "10.244.3.3")
    tracker.update(None, a)
    tracker.update(None, b)
    em.update_from(tracker)
    tracker.update(a, es("web-1", HTTP, "10.244.1.1"))
    # as kube-proxy's endpointSliceCache: slices are compared at update, endpoints at checkout
    assert tracker.update(b, es("web-2", HTTP, "10.244.2.2", "10.244.3.3"))
    change = em.update_from(tracker)
    assert change.updated == set() and change.removed == {} and not tracker.pending()
    assert [str(e.ip) for e in em[HTTP]] == ["10.244.1.1", "10.244.2.2", "10.244.3.3"]
