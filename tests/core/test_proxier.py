"""Proxier with a FakeDatapath: no sync before every source listed, only changed ServicePorts are
handed over, a failed sync makes the next one full, endpoints equal to a ClusterIP are refused,
traffic policies shape cluster/external endpoints with this node's name, placement shows a relay
error under offload, and an offload wake-up is no source change in the programming latency."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.core.helpers import eps, service, spn
from usproxy.util.metrics import Metrics
from usproxy.core.datapath import FakeDatapath
from usproxy.model.endpoint import Endpoint, categorize
from usproxy.model.node import NodeFacts
from usproxy.offload.fake import FakeKernelDatapath
from usproxy.offload.manager import OffloadManager
from usproxy.offload.settings import OffloadSettings
from usproxy.core.proxier import Proxier


async def test_no_sync_before_all_sources_listed() -> None:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_service_update(None, service("a", "10.96.0.1"))
    p.on_services_synced()
    await p.sync()
    assert fake.syncs == []
    p.on_endpoint_slices_synced()
    await p.sync()
    assert len(fake.syncs) == 1 and fake.syncs[0].full


async def test_only_changed_service_ports_are_synced() -> None:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    for n, ip in (("a", "10.96.0.1"), ("b", "10.96.0.2")):
        p.on_service_update(None, service(n, ip))
        p.on_endpoint_slice_update(None, eps(n, "10.244.1.1"))
    await p.sync()
    p.on_endpoint_slice_update(eps("b", "10.244.1.1"), eps("b", "10.244.2.2"))
    await p.sync()
    last = fake.syncs[-1]
    assert set(last.changes) == {spn("b")} and not last.full
    assert {str(e.ip) for e in last.removed_endpoints[spn("b")]} == {"10.244.1.1"}
    assert fake.dump() == ("default/a/TCP 10.96.0.1:80 -> 10.244.1.1:8080\n"
                           "default/b/TCP 10.96.0.2:80 -> 10.244.2.2:8080")
    p.on_service_update(service("a", "10.96.0.1"), None)
    await p.sync()
    assert fake.syncs[-1].changes == {spn("a"): None}


async def test_failed_sync_makes_next_sync_full() -> None:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    await p.sync()
    p.on_service_update(None, service("b", "10.96.0.2"))
    fake.fail_next = 1
    with pytest.raises(RuntimeError, match="injected sync failure"):
        await p.sync()
    await p.sync()
    assert fake.syncs[-1].full and set(fake.syncs[-1].changes) == {spn("a"), spn("b")}


async def test_endpoint_equal_to_a_cluster_ip_is_refused() -> None:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    p.on_service_update(None, service("b", "10.96.0.2"))
    p.on_endpoint_slice_update(None, eps("a", "10.96.0.2", "10.244.1.1"))
    await p.sync()
    assert [str(e.ip) for e in fake.state[spn("a")].cluster_endpoints] == ["10.244.1.1"]


def test_traffic_policies_and_terminating_fallback() -> None:
    sp = service("a", "10.96.0.1", internal_traffic_policy="Local", external_traffic_policy="Cluster").ports[spn("a")]
    here = Endpoint(ipaddress.ip_address("10.244.1.1"), 80, node_name="me")
    there = Endpoint(ipaddress.ip_address("10.244.2.2"), 80, node_name="other")
    cat = categorize(sp, (here, there), "me")
    assert cat.cluster == (here,) and cat.external == (here, there)
    dying = Endpoint(ipaddress.ip_address("10.244.3.3"), 80, ready=False, serving=True, terminating=True)
    gone = Endpoint(ipaddress.ip_address("10.244.4.4"), 80, ready=False, serving=False, terminating=True)
    plain = service("b", "10.96.0.2").ports[spn("b")]
    assert categorize(plain, (dying, gone), None).cluster == (dying,)
    assert categorize(plain, (dying, here), None).cluster == (here,)


async def test_cluster_ip_refusal_follows_services_coming_and_going() -> None:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    p.on_endpoint_slice_update(None, eps("a", "10.96.0.9", "10.244.1.1"))
    await p.sync()
    assert len(fake.state[spn("a")].cluster_endpoints) == 2
    p.on_service_update(None, service("b", "10.96.0.9"))  # 10.96.0.9 becomes a ClusterIP
    await p.sync()
    assert [str(e.ip) for e in fake.state[spn("a")].cluster_endpoints] == ["10.244.1.1"]
    p.on_service_update(service("b", "10.96.0.9"), None)  # and stops being one
    await p.sync()
    assert len(fake.state[spn("a")].cluster_endpoints) == 2


async def test_service_ports_gauge_counts_placements_at_scrape() -> None:
    from prometheus_client import generate_latest

    fake = FakeDatapath("userspace")
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    await p.sync()
    text = generate_latest(p.metrics.registry).decode()
    assert 'usproxy_service_ports{datapath="userspace"} 1.0' in text


async def test_pending_change_gauges_follow_the_trackers() -> None:
    p = Proxier([FakeDatapath()])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    p.on_endpoint_slice_update(None, eps("a", "10.244.1.1"))
    assert p.metrics.service_changes_pending._value.get() == 1
    assert p.metrics.endpoint_changes_pending._value.get() == 1
    await p.sync()
    assert p.metrics.service_changes_pending._value.get() == 0
    assert p.metrics.endpoint_changes_pending._value.get() == 0


async def test_local_endpoints_follow_the_node_name() -> None:
    async def local_endpoints(node: str) -> list[str]:
        fake = FakeDatapath()
        p = Proxier([fake], node=NodeFacts(node))
        p.on_services_synced()
        p.on_endpoint_slices_synced()
        p.on_service_update(None, service("a", "10.96.0.1", internal_traffic_policy="Local"))
        p.on_endpoint_slice_update(None, eps("a", "10.244.1.1", node="node-a"))
        await p.sync()
        return [str(e.ip) for e in fake.state[spn("a")].cluster_endpoints]

    assert await local_endpoints("node-a") == ["10.244.1.1"]
    assert await local_endpoints("node-b") == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def offload(after: float, kernel: FakeKernelDatapath, request_sync: Callable[[], None],
            clock: Callable[[], float] = time.monotonic) -> OffloadManager:
    settings = OffloadSettings("nftables", after, "roundRobin", Path("/nonexistent"))
    return OffloadManager(settings, [kernel], request_sync=request_sync, clock=clock)


async def test_relay_listener_error_is_shown_while_offload_establishes() -> None:
    """Once offload is on, a relay listener error still reaches /services (it was shown as
    "establishing"); the kernel's placement wins once the kernel serves the ServicePort."""
    relay, nft, clock = FakeDatapath("userspace"), FakeKernelDatapath(), Clock()
    p = Proxier([relay, offload(5.0, nft, request_sync=lambda: None, clock=clock)])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    p.on_endpoint_slice_update(None, eps("a", "10.244.1.1"))
    await p.sync()
    clock.now += 1.0
    assert (p.placement(spn("a")).datapath, p.placement(spn("a")).reason) == ("userspace", "establishing: 1.0s of 5.0s")
    relay.errors[spn("a")] = "listen 10.96.0.1:80: Address already in use"
    where = p.placement(spn("a"))
    assert (where.datapath, where.reason) == ("userspace", "listen 10.96.0.1:80: Address already in use")
    clock.now += 4.0
    await p.sync()
    assert spn("a") in nft.installed and p.placement(spn("a")).datapath == "nftables"


async def test_offload_wake_up_is_not_a_source_change_in_programming_latency() -> None:
    """kubeproxy_network_programming_duration_seconds counts source changes only: the sync the
    offload manager asks for when a window ends adds no observation."""
    metrics, nft = Metrics(), FakeKernelDatapath()
    p: Proxier | None = None

    def wake() -> None:
        assert p is not None
        p.request_sync()

    p = Proxier([offload(0.05, nft, request_sync=wake)], metrics=metrics, min_sync_period=0.01)
    runner = asyncio.create_task(p.runner.loop())
    try:
        p.on_service_update(None, service("a", "10.96.0.1"))
        p.on_endpoint_slice_update(None, eps("a", "10.244.1.1"))
        p.on_services_synced()
        p.on_endpoint_slices_synced()
        async with asyncio.timeout(3):
            while spn("a") not in nft.installed:  # installed by the sync the wake-up asked for
                await asyncio.sleep(0.01)
        assert p.runner.runs >= 2
        count = metrics.registry.get_sample_value("kubeproxy_network_programming_duration_seconds_count")
        assert count == 1
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await p.close()


async def test_service_ports_gauge_staged_only_for_its_scrape() -> None:
    """Metrics.scrape counts placements in chunks before rendering; the counts it staged are
    dropped after its render, so a later render counts afresh (never a stale scrape's counts)."""
    from prometheus_client import generate_latest

    p = Proxier([FakeDatapath("userspace")])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    p.on_service_update(None, service("a", "10.96.0.1"))
    await p.sync()
    assert 'usproxy_service_ports{datapath="userspace"} 1.0' in (await p.metrics.scrape()).decode()
    p.on_service_update(None, service("b", "10.96.0.2"))
    await p.sync()
    assert 'usproxy_service_ports{datapath="userspace"} 2.0' in generate_latest(p.metrics.registry).decode()
    assert (await p.metrics.scrape()) == generate_latest(p.metrics.registry)


async def test_a_large_sync_leaves_the_collector_no_young_heap() -> None:
    """A large sync freezes what it built before the collector is back on (gc_pause): the
    collector's first pass after the sync walked every object of it (the largest stall of a cold
    start: ~1 s at 10,000 Services on a loaded machine), now each pass finds only what came since.
    Fails when the freeze comes after the pause ends."""
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    for i in range(2000):
        p.on_service_update(None, service(f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}"))
        p.on_endpoint_slice_update(None, eps(f"s{i}", "10.244.1.1"))
    young: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            young.append(len(gc.get_objects(generation=0)))
    gc.collect()
    gc.callbacks.append(seen)
    try:
        await p.sync()
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()  # the tests after this one see the heap as before
    assert len(fake.syncs) == 1 and len(fake.syncs[0].changes) == 2000
    assert max(young, default=0) < 2000, young
