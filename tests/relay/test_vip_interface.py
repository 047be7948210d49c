"""VipInterface (usproxy/relay/vip_interface.py) in a throwaway network namespace: IPv4 addresses
are made local by local routes (usproxy's protocol, table local, the address as their source),
IPv6 ones are addresses; a routed address is local for the kernel as an address is (a listener
binds to it without IP_FREEBIND, a node's connection to it takes it as its source, a port nobody
listens on is refused); a restarted agent finds both kinds again and turns an IPv4 address an
older version left into a route; routes the kernel flushed (the interface lost its last IPv4 address) are added
again by repair() (a link going down and up keeps them). Also address_batch's route functions on their own:
adding twice and deleting twice succeed, a refusal names the address and the kernel's errno."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket

import pytest

from tests.netns import Topology, inside, nsexec
from usproxy.model.types import IPAddress
from usproxy.relay.address_batch import BATCH, RTPROT_USPROXY, add_local_routes, delete_local_routes, local_routes
from usproxy.relay.vip_interface import VipInterface

V4: list[IPAddress] = [ipaddress.ip_address(f"10.96.{210 + i // 250}.{i % 250 + 1}") for i in range(2 * BATCH + 5)]
V6: list[IPAddress] = [ipaddress.ip_address(f"2001:db8:96::{i:x}") for i in range(1, 6)]


def routes(ns: str, dev: str) -> dict[str, str]:
    """`ip route show table local dev DEV` for IPv4: destination -> the rest of the line."""
    out = nsexec(ns, "ip", "-4", "route", "show", "table", "local", "dev", dev).stdout
    return {line.split()[1]: line for line in out.splitlines()}


def addresses(ns: str, dev: str) -> set[str]:
    return {row.split()[3] for row in nsexec(ns, "ip", "-o", "addr", "show", "dev", dev, "scope", "global").stdout.splitlines()}


def test_ipv4_by_local_routes_ipv6_as_addresses(topology: Topology) -> None:
    ns = topology.node
    with inside(ns):
        asyncio.run(_add_and_use(ns))
    with inside(ns):
        asyncio.run(_restart_and_remove(ns))


async def _add_and_use(ns: str) -> None:
    vip = VipInterface("uspvi0")
    await vip.setup()
    try:
        await vip.add_many(V4 + V6)
        await vip.add_many(V4[:3])  # already there: nothing sent
    finally:
        vip.worker.close()
    held = routes(ns, "uspvi0")
    assert set(held) == {str(ip) for ip in V4}
    line = held["10.96.210.1"]
    assert line.split()[0] == "local" and f"proto {RTPROT_USPROXY}" in line and "scope host" in line \
        and "src 10.96.210.1" in line, line
    assert addresses(ns, "uspvi0") == {f"{ip}/128" for ip in V6}  # IPv6 only: no IPv4 address
    assert vip.addresses == set(V4 + V6) and vip.routed == set(V4)
    # local for the kernel: bind without IP_FREEBIND, the node's own connection takes the address as
    # its source, a port without a listener is refused
    with socket.socket() as srv:
        srv.bind(("10.96.210.7", 8080))
        srv.listen()
        with socket.create_connection(("10.96.210.7", 8080), timeout=5) as cli:
            conn, peer = srv.accept()
            conn.close()
            assert peer[0] == cli.getsockname()[0] == "10.96.210.7"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("10.96.210.8", 8081), timeout=5).close()


async def _restart_and_remove(ns: str) -> None:
    nsexec(ns, "ip", "addr", "add", "10.96.250.1/32", "dev", "uspvi0")  # as an older version added it
    vip = VipInterface("uspvi0")
    await vip.setup()
    try:
        old = ipaddress.ip_address("10.96.250.1")
        assert vip.addresses == set(V4 + V6) | {old} and vip.routed == set(V4) | {old}
        # the old address is a route now; the routes the address's removal flushed are back
        assert set(routes(ns, "uspvi0")) == {str(ip) for ip in V4} | {"10.96.250.1"}
        assert addresses(ns, "uspvi0") == {f"{ip}/128" for ip in V6}
        await vip.remove(V4[0])
        await vip.remove(V6[0])
        await vip.remove(old)
        assert set(routes(ns, "uspvi0")) == {str(ip) for ip in V4[1:]}
        assert addresses(ns, "uspvi0") == {f"{ip}/128" for ip in V6[1:]}
        assert not await vip.repair()  # nothing missing
        nsexec(ns, "ip", "link", "set", "uspvi0", "down")  # local routes outlive that
        nsexec(ns, "ip", "link", "set", "uspvi0", "up")
        assert not await vip.repair()
        nsexec(ns, "ip", "addr", "add", "192.0.2.1/32", "dev", "uspvi0")
        nsexec(ns, "ip", "addr", "del", "192.0.2.1/32", "dev", "uspvi0")  # its last: every route via it goes
        assert routes(ns, "uspvi0") == {}
        assert await vip.repair()
        assert set(routes(ns, "uspvi0")) == {str(ip) for ip in V4[1:]}
    finally:
        vip.worker.close()


def test_route_batches_count_what_is_there_and_name_refusals(topology: Topology) -> None:
    ns = topology.node
    nsexec(ns, "ip", "link", "add", "uspvr0", "type", "bridge")
    ips = [ipaddress.IPv4Address(f"10.96.220.{i}") for i in range(1, 200)]
    with inside(ns):
        index = socket.if_nametoindex("uspvr0")
        add_local_routes(index, ips)
        add_local_routes(index, ips[:5])  # EEXIST: added
        nsexec(ns, "ip", "route", "add", "local", "10.96.221.1", "dev", "uspvr0", "table", "local")  # not ours
        assert local_routes(index) == set(ips)
        delete_local_routes(index, ips[:100])
        delete_local_routes(index, ips[:3])  # ESRCH: deleted
        assert local_routes(index) == set(ips[100:])
        with pytest.raises(OSError) as err:
            add_local_routes(index + 1000, ips[:1])
    assert err.value.errno == errno.ENODEV and "10.96.220.1" in str(err.value)
