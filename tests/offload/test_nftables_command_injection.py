"""Class "nftables command injection" (issue 18, item 4), against a real `nft` in a throwaway
namespace: an element whose comment is a hostile name (a quote, tabs, newlines, an `add table`)
is loaded as one element of the usproxy table, and no foreign table or element appears. The
parsing side (names refused naming the field) is tests/model/test_name_validation.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.model.hostile import HOSTILE
from tests.netns import Topology, nsexec
from usproxy.offload.nftables.client import NftClient
from usproxy.offload.nftables.commands import Command, Elem, base_commands
from usproxy.offload.nftables.names import comment_of
from usproxy.model.types import ServicePortName

pytestmark = pytest.mark.netns


def test_command_injection_real_nft_creates_no_foreign_table(topology: Topology) -> None:
    spn = ServicePortName("default", HOSTILE, "http", "TCP")
    elems = (Elem("10.96.0.10 . tcp . 80", "goto reject-chain", comment_of(spn, "cluster")),
             Elem("10.96.0.11 . tcp . 80", "goto reject-chain", HOSTILE))  # not through comment_of
    client = NftClient(topology.node)
    try:
        asyncio.run(client.apply([*base_commands(4), Command("add", "element", 4, "service-ips", elems=elems)]))
    finally:
        client.close()
    tables = nsexec(topology.node, "nft", "list", "tables").stdout.split()
    assert tables == ["table", "ip", "usproxy"]
    listing = json.loads(nsexec(topology.node, "nft", "-j", "list", "map", "ip", "usproxy", "service-ips").stdout)
    [elements] = [x["map"]["elem"] for x in listing["nftables"] if "map" in x]
    keys = [e[0]["elem"]["val"]["concat"][0] for e in elements]
    assert sorted(keys) == ["10.96.0.10", "10.96.0.11"]  # no foreign 10.0.0.1 element
    assert all("pwned" in e[0]["elem"]["comment"] for e in elements)  # the name stayed in its comment
