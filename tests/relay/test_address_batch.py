"""add_addresses (usproxy/relay/address_batch.py), in a throwaway network namespace: thousands of
host addresses (IPv4 /32, IPv6 /128 without DAD) land on the interface exactly as listed, an
address already there counts as added, and a refusal raises OSError with the kernel's errno."""

from __future__ import annotations

import errno
import ipaddress
import socket

import pytest

from tests.netns import Topology, inside, nsexec
from usproxy.model.types import IPAddress
from usproxy.relay.address_batch import BATCH, add_addresses
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
