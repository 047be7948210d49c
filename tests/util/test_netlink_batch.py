"""add_addresses and requests (usproxy/util/netlink_batch.py), in a throwaway network namespace: thousands of
host addresses (IPv4 /32, IPv6 /128 without DAD) land on the interface exactly as listed, an
address already there counts as added, and a refusal raises OSError with the kernel's errno."""

from __future__ import annotations

import errno
import ipaddress
import socket
from functools import partial

import pytest

from tests.netns import Topology, inside, nsexec
from usproxy.model.types import IPAddress
from usproxy.util.netlink_batch import BATCH, add_addresses, newaddr, requests
from usproxy.relay.vip_interface import IFA_F_NODAD


def test_thousands_of_addresses_land_as_listed(topology: Topology) -> None:
    ns = topology.node
    nsexec(ns, "ip", "link", "add", "uspab0", "type", "bridge")
    ips: list[IPAddress] = [ipaddress.ip_address(f"10.96.{200 + i // 250}.{i % 250 + 1}") for i in range(3 * BATCH + 7)]
    ips += [ipaddress.ip_address(f"2001:db8::{i:x}") for i in range(1, 40)]
    with inside(ns):
        index = socket.if_nametoindex("uspab0")
        add_addresses(index, ips, IFA_F_NODAD)
        add_addresses(index, ips[:10] + ips[-3:], IFA_F_NODAD)  # again: EEXIST is success
        with pytest.raises(OSError) as err:
            add_addresses(index + 1000, ips[:1], IFA_F_NODAD)
    assert err.value.errno == errno.ENODEV and "10.96.200.1" in str(err.value)
    rows = nsexec(ns, "ip", "-o", "addr", "show", "dev", "uspab0").stdout.splitlines()
    shown = {row.split()[3] for row in rows}
    assert shown == {f"{ip}/{32 if ip.version == 4 else 128}" for ip in ips}
    assert all("nodad" in row for row in rows if " inet6 " in row)


def test_requests_returns_each_messages_errno_in_order_across_batches(topology: Topology) -> None:
    """The kernel runs every message of a sendmsg whatever the others' outcome: a refused one in
    the middle of a batch leaves those after it done, and each errno comes back in its place."""
    ns = topology.node
    nsexec(ns, "ip", "link", "add", "uspab1", "type", "bridge")
    ips = [ipaddress.ip_address(f"10.96.210.{i + 1}") for i in range(BATCH + 20)]
    with inside(ns):
        index = socket.if_nametoindex("uspab1")
        add_addresses(index, ips[:5], IFA_F_NODAD)
        bad = {3: index + 1000, BATCH + 4: index + 1000}  # no such interface
        codes = requests(socket.NETLINK_ROUTE, [
            partial(newaddr, index=bad.get(n, index), ip=ip, flags=IFA_F_NODAD) for n, ip in enumerate(ips)])
    assert codes == [errno.ENODEV if n in bad else errno.EEXIST if n < 5 else 0 for n in range(len(ips))]
    shown = {row.split()[3] for row in nsexec(ns, "ip", "-o", "addr", "show", "dev", "uspab1").stdout.splitlines()}
    assert shown == {f"{ip}/32" for n, ip in enumerate(ips) if n not in bad or n < 5}
