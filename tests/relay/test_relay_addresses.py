"""Relay frontend addresses, without a kernel: a deleted Service's address stays refusing, bounded.

Fault class: releasing everything on delete without blackholing the deleted Service's clients
(C21 (4)): an address no ServicePort uses stays on the interface, with no listener (so the kernel
refuses), for RELEASE_AFTER seconds and at most MAX_RELEASED of them, and is removed afterwards; an
address claimed again in the meantime is kept and never removed under its new user.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator

import pytest

import usproxy.relay.relay as relay_mod
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import ServicePortState, SyncRequest
from usproxy.model.node import NodeFacts
from usproxy.relay.relay import MAX_RELEASED, RELEASE_AFTER, Relay, RelaySettings
from usproxy.model.service_port import ServicePort
from usproxy.model.types import IPAddress, ServicePortName


class FakeWorker:
    """The netlink worker the relay routes the Service CIDRs through: nothing to route here."""

    async def call(self, fn: object) -> list[str]:
        return []


class FakeVip:
    name, kind = "usproxy0", "fake"

    def __init__(self) -> None:
        self.addresses: set[IPAddress] = set()
        self.removed: list[IPAddress] = []
        self.worker = FakeWorker()

    async def setup(self) -> None:
        pass

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        self.addresses.update(ips)

    async def remove(self, ip: IPAddress) -> None:
        self.addresses.discard(ip)
        self.removed.append(ip)

    async def local_addresses(self) -> list[tuple[str, IPAddress]]:
        return []

    async def close(self) -> None:
        pass


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTime]:
    fake = FakeTime()
    monkeypatch.setattr(relay_mod, "time", fake)
    yield fake


def state(name: str, ip: str) -> tuple[ServicePortName, ServicePortState]:
    spn = ServicePortName("default", name, "", "TCP")
    sp = ServicePort(spn, (ipaddress.ip_address(ip),), 80, 8080)
    return spn, ServicePortState(sp, (), (), ())  # no endpoints: no listener, only the address


async def test_deleted_address_stays_then_goes(clock: FakeTime) -> None:
    vip = FakeVip()
    relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
    try:
        a_spn, a = state("a", "10.96.0.1")
        await relay.sync(SyncRequest({a_spn: a}))
        assert vip.addresses == {ipaddress.ip_address("10.96.0.1")}
        await relay.sync(SyncRequest({a_spn: None}))
        assert vip.addresses == {ipaddress.ip_address("10.96.0.1")}  # refused, not blackholed
        clock.now += RELEASE_AFTER - 1
        await relay.sync(SyncRequest({}))
        assert vip.addresses and not vip.removed
        clock.now += 1
        await relay.sync(SyncRequest({}))
        assert vip.addresses == set() and vip.removed == [ipaddress.ip_address("10.96.0.1")]
    finally:
        await relay.close()


async def test_address_claimed_again_is_kept(clock: FakeTime) -> None:
    vip = FakeVip()
    relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
    try:
        a_spn, a = state("a", "10.96.0.1")
        b_spn, b = state("b", "10.96.0.1")
        await relay.sync(SyncRequest({a_spn: a}))
        await relay.sync(SyncRequest({a_spn: None}))
        clock.now += RELEASE_AFTER / 2
        await relay.sync(SyncRequest({b_spn: b}))
        clock.now += RELEASE_AFTER * 2
        await relay.sync(SyncRequest({}))
        assert vip.addresses == {ipaddress.ip_address("10.96.0.1")} and not vip.removed
    finally:
        await relay.close()


async def test_released_addresses_are_bounded(clock: FakeTime) -> None:
    vip = FakeVip()
    relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
    try:
        n = MAX_RELEASED + 10
        states = [state(f"s{i}", str(ipaddress.ip_address("10.96.0.0") + 1 + i)) for i in range(n)]
        await relay.sync(SyncRequest(dict(states)))
        for spn, _ in states:  # deleted one by one, oldest first
            clock.now += 0.001
            await relay.sync(SyncRequest({spn: None}))
        assert len(vip.addresses) == MAX_RELEASED
        assert vip.removed == [states[i][1].service_port.cluster_ip for i in range(10)]
    finally:
        await relay.close()
