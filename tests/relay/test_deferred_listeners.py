"""Relay.kernel_serves (issue 30 item 1), in a throwaway network namespace: a new ServicePort the
kernel serves from its first sync gets its listener right after the sync instead of before the
kernel step, and still gets it (the relay stays the fallback); one removed meanwhile gets none;
a sync that touches a waiting ServicePort the kernel still serves leaves it waiting, one the
kernel no longer serves opens at once; a sync whose ServicePorts all wait does not wait for the
addresses an earlier sync is still adding; without the hook, listeners open inside the sync as
always. On both event loops."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from collections.abc import Iterable

import pytest
import uvloop

from tests.netns import Topology, inside, nsexec
from usproxy.core.datapath import ServicePortState, SyncRequest
from usproxy.model.config import ProxyConfig
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import NodeFacts
from usproxy.model.service_port import ServicePort
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.relay.relay import Relay, RelaySettings
from usproxy.util.netlink_worker import NetlinkWorker


class Vip:
    """The ClusterIP interface's part, without netlink (the test adds the addresses itself)."""

    name, kind = "usproxy0", "fake"

    def __init__(self) -> None:
        self.addresses: set[IPAddress] = set()

    async def setup(self) -> None:
        pass

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        self.addresses.update(ips)

    async def remove(self, ip: IPAddress) -> None:
        self.addresses.discard(ip)

    async def local_addresses(self) -> list[tuple[str, IPAddress]]:
        return []

    async def close(self) -> None:
        pass


def state(name: str, ip: str) -> tuple[ServicePortName, ServicePortState]:
    spn = ServicePortName("default", name, "", "TCP")
    sp = ServicePort(spn, (ipaddress.ip_address(ip),), 80, 8080)
    eps = (Endpoint(ipaddress.ip_address("10.244.9.9"), 8080),)
    return spn, ServicePortState(sp, eps, eps, eps)


def listening(relay: Relay, ip: str) -> bool:
    return (ip, 80, "TCP") in relay.listening


async def wait_opened(relay: Relay) -> None:
    for _ in range(200):
        if not relay._deferred and (relay._opener is None or relay._opener.done()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("deferred listeners never opened")


def test_listeners_of_what_the_kernel_serves_open_after_the_sync(topology: Topology, loop_name: str) -> None:
    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    run(_listeners_open_after_the_sync(topology))


async def _listeners_open_after_the_sync(topology: Topology) -> None:
    for ip in ("10.96.77.1", "10.96.77.2", "10.96.77.3", "10.96.77.4"):
        nsexec(topology.node, "ip", "addr", "add", f"{ip}/32", "dev", "lo")
    with inside(topology.node):
        relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=Vip())  # type: ignore[arg-type]
        relay.kernel_serves = lambda st: st.service_port.name.name != "plain"
        try:
            a, b, c, plain = state("a", "10.96.77.1"), state("b", "10.96.77.2"), state("c", "10.96.77.3"), \
                state("plain", "10.96.77.4")
            await relay.sync(SyncRequest(dict([a, b, c, plain])))
            # right after the sync: only the ServicePort no kernel serves listens
            assert listening(relay, "10.96.77.4") and not listening(relay, "10.96.77.1")
            placement = relay.placement(a[0])
            assert placement is not None and "after the kernel step" in placement.reason
            await relay.sync(SyncRequest({b[0]: None, c[0]: c[1]}))  # b removed; c touched, still the kernel's
            assert not listening(relay, "10.96.77.3") and not listening(relay, "10.96.77.2")
            relay.kernel_serves = lambda st: st.service_port.name.name not in ("plain", "a")
            await relay.sync(SyncRequest(dict([a])))  # a touched, no longer the kernel's: it opens now
            assert listening(relay, "10.96.77.1")
            await wait_opened(relay)
            assert listening(relay, "10.96.77.3") and not listening(relay, "10.96.77.2")
            placement = relay.placement(a[0])
            assert placement is not None and placement.reason.startswith("listening on 10.96.77.1:80")
        finally:
            await relay.close()


class GatedVip(Vip):
    """add_many waits for `gate` (the kernel adding 10,000 addresses) and fails `fail` times."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.fail = 0
        self.calls: list[set[IPAddress]] = []

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        wanted = set(ips)
        self.calls.append(wanted)
        await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise OSError(105, "No buffer space available")
        self.addresses.update(wanted)


def test_addresses_of_what_the_kernel_serves_are_added_beside_the_sync(topology: Topology, loop_name: str) -> None:
    """When every ServicePort a sync brings waits for the kernel step, the sync does not wait for
    its addresses (the kernel's O(n) per address); the deferred listeners do; a failed add is
    done again, all of it, at the next sync."""
    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    run(_addresses_beside_the_sync(topology))


async def _addresses_beside_the_sync(topology: Topology) -> None:
    for ip in ("10.96.78.1", "10.96.78.2"):
        nsexec(topology.node, "ip", "addr", "add", f"{ip}/32", "dev", "lo")
    with inside(topology.node):
        vip = GatedVip()
        relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
        relay.kernel_serves = lambda st: True
        try:
            a, b = state("a", "10.96.78.1"), state("b", "10.96.78.2")
            vip.fail = 1
            await asyncio.wait_for(relay.sync(SyncRequest(dict([a]))), 5)  # returns with the add pending
            assert vip.addresses == set() and not listening(relay, "10.96.78.1")
            await asyncio.sleep(0.05)
            assert not listening(relay, "10.96.78.1")  # the listener waits for its address
            vip.gate.set()  # the add fails: logged, done again at the next sync
            await wait_opened(relay)
            await relay.sync(SyncRequest(dict([b])))
            await wait_opened(relay)
            assert vip.calls[-2:] == [{ipaddress.ip_address("10.96.78.1")}, {ipaddress.ip_address("10.96.78.2")}]
            assert vip.addresses == {ipaddress.ip_address("10.96.78.1"), ipaddress.ip_address("10.96.78.2")}
            assert listening(relay, "10.96.78.1") and listening(relay, "10.96.78.2")
        finally:
            await relay.close()


class HeldWorkerVip(Vip):
    """add_many holds the interface's netlink thread until `released` (the kernel adding
    10,000 addresses: 1.3 s of its time, measured with `ip -batch`)."""

    def __init__(self) -> None:
        super().__init__()
        self.worker = NetlinkWorker()
        self.released = threading.Event()

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        wanted = set(ips)
        await self.worker.call(lambda ipr: self.released.wait(10))
        self.addresses.update(wanted)

    async def close(self) -> None:
        self.released.set()
        self.worker.close()


def test_the_hairpin_rules_do_not_wait_behind_the_address_add(topology: Topology, loop_name: str) -> None:
    """With hairpins on (--hairpin-mark), the first sync ends with the hairpin table and policy
    rules written: in a netlink thread of their own, so that sync (hence the kernel step after
    it) does not wait for the addresses added beside it. It did: 1.2 s of a 10,000-Service cold
    start (bench/startup.py, 3.06 s then 1.91 s)."""
    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    run(_hairpin_rules_beside_the_add(topology))


async def _hairpin_rules_beside_the_add(topology: Topology) -> None:
    nsexec(topology.node, "ip", "addr", "add", "10.96.79.1/32", "dev", "lo")
    with inside(topology.node):
        vip = HeldWorkerVip()
        relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
        relay.kernel_serves = lambda st: True
        relay.return_mark = 0x1000
        try:
            a = state("a", "10.96.79.1")
            await asyncio.wait_for(relay.sync(SyncRequest(dict([a]))), 5)  # the add still holds its thread
            assert vip.addresses == set()
            rules = nsexec(topology.node, "ip", "rule").stdout
            assert "fwmark 0x1000" in rules, rules
            vip.released.set()
            await wait_opened(relay)
            assert vip.addresses == {ipaddress.ip_address("10.96.79.1")}
        finally:
            vip.released.set()
            await relay.close()


def test_an_endpoint_change_does_not_wait_for_the_addresses_of_the_start(topology: Topology, loop_name: str) -> None:
    """The first change after a cold start came 0.6 s late (bench/startup.py, Kubernetes mode,
    10,000 Services): its sync, and the deferred listeners' opener holding the sync lock, waited
    for the kernel to add the start's addresses. A sync whose ServicePorts the kernel serves
    waits for neither; the listeners still open once the addresses are there."""
    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    run(_change_beside_the_add(topology))


async def _change_beside_the_add(topology: Topology) -> None:
    nsexec(topology.node, "ip", "addr", "add", "10.96.80.1/32", "dev", "lo")
    with inside(topology.node):
        vip = GatedVip()
        relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
        relay.kernel_serves = lambda st: True
        try:
            spn, st = state("a", "10.96.80.1")
            await asyncio.wait_for(relay.sync(SyncRequest({spn: st})), 5)
            await asyncio.sleep(0.05)  # the opener is waiting for the addresses
            eps = (Endpoint(ipaddress.ip_address("10.244.9.8"), 8080),)
            moved = ServicePortState(st.service_port, eps, eps, eps)  # its endpoint moved
            await asyncio.wait_for(relay.sync(SyncRequest({spn: moved})), 2)  # the add still runs
            assert vip.addresses == set() and not listening(relay, "10.96.80.1")
            vip.gate.set()
            await wait_opened(relay)
            assert listening(relay, "10.96.80.1")
            assert relay.ports[spn].state is moved  # the listener opened with the change's state
        finally:
            vip.gate.set()
            await relay.close()


def test_a_large_batch_of_opened_listeners_is_frozen_out_of_the_collector(
        topology: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listeners opened after the kernel step live as long as their ServicePorts: from LARGE of
    them on, the opener freezes the heap (gc_pause.freeze_heap) as a large sync does, so the
    collector's full passes do not walk them (a cold start's 10,000: 0.25 s of CPU each)."""
    from usproxy.relay import relay as relay_module

    frozen: list[int] = []
    monkeypatch.setattr(relay_module, "LARGE", 3)
    monkeypatch.setattr(relay_module, "freeze_heap", lambda: frozen.append(1))
    asyncio.run(_opened_batch(topology, frozen))


async def _opened_batch(topology: Topology, frozen: list[int]) -> None:
    ips = [f"10.96.80.{i}" for i in range(1, 5)]
    for ip in ips:
        nsexec(topology.node, "ip", "addr", "add", f"{ip}/32", "dev", "lo")
    with inside(topology.node):
        relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=Vip())  # type: ignore[arg-type]
        relay.kernel_serves = lambda st: True
        try:
            await relay.sync(SyncRequest(dict(state(f"s{i}", ip) for i, ip in enumerate(ips[:2]))))
            await wait_opened(relay)
            assert frozen == []  # two: below LARGE
            await relay.sync(SyncRequest(dict(state(f"t{i}", ip) for i, ip in enumerate(ips[1:]))))
            await wait_opened(relay)
            assert frozen == [1]  # three in one go: frozen once, after the last one opened
            assert all(listening(relay, ip) for ip in ips)
        finally:
            await relay.close()
