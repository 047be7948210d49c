"""return_route.py's policy rules in a throwaway netns: `local` moves behind the mark rule and
back, both idempotent; a `local` rule another agent moved (Cilium's at 100) is left where it is. The traffic itself:
tests/offload/test_lb_ip_source.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from pyroute2 import IPRoute

from tests.netns import Topology, inside, nsexec
from usproxy.relay import return_route

pytestmark = pytest.mark.netns


def rules(ns: str) -> list[str]:
    """`ip rule` lines without the priority's padding, e.g. "0: from all lookup local"."""
    return [re.sub(r"\s+", " ", line.strip()) for line in nsexec(ns, "ip", "rule").stdout.splitlines()]


MARK = return_route.DEFAULT_MARK


def reconcile(ipr: Any, mark: int = MARK) -> list[str]:
    return return_route.reconcile_rules(ipr, mark)


def call(ns: str, fn: Callable[[Any], list[str]]) -> list[str]:
    with inside(ns):
        ipr = IPRoute()
    try:
        return list(fn(ipr))
    finally:
        ipr.close()


def test_local_moves_behind_the_mark_rule_and_back(topology: Topology) -> None:
    node = topology.node
    before = rules(node)
    assert before[0] == "0: from all lookup local"
    assert call(node, reconcile)
    moved = rules(node)
    assert moved[:2] == ["99: from all fwmark 0x1000/0x1000 lookup main proto 67", "100: from all lookup local proto 67"]
    assert not any(r.startswith("0:") for r in moved)
    assert call(node, reconcile) == [] and rules(node) == moved  # idempotent
    assert call(node, return_route.remove_rules)
    assert rules(node) == before
    assert call(node, return_route.remove_rules) == [] and rules(node) == before


def test_a_local_rule_someone_else_moved_stays(topology: Topology) -> None:
    node = topology.node
    nsexec(node, "ip", "rule", "add", "pref", "100", "lookup", "local")
    nsexec(node, "ip", "rule", "del", "pref", "0")
    theirs = rules(node)
    assert call(node, reconcile) == [f"+rule 99 fwmark {MARK:#x} lookup main"]
    assert call(node, return_route.remove_rules) == ["-rule 99"]
    assert rules(node) == theirs


def test_a_new_hairpin_mark_replaces_the_old_rule(topology: Topology) -> None:
    """An agent restarted with another --hairpin-mark: one mark rule, the new one."""
    node = topology.node
    call(node, reconcile)
    assert call(node, lambda ipr: reconcile(ipr, 0x2000)) == ["+rule 99 fwmark 0x2000 lookup main",
                                                             f"-rule 99 fwmark {MARK:#x}"]
    assert [r for r in rules(node) if "fwmark" in r] == ["99: from all fwmark 0x2000/0x2000 lookup main proto 67"]


def test_table_exists_asks_for_its_own_table_only(topology: Topology) -> None:
    """The watch's check (every WATCH_PERIOD): true only for table ip usproxy-return; a table of
    another name (the nftables datapath's, another program's) does not make it true."""
    import asyncio

    def exists() -> bool:
        with inside(topology.node):
            return asyncio.run(return_route.table_exists())

    nsexec(topology.node, "nft", "add", "table", "ip", "usproxy-returned")  # a longer name, not ours
    nsexec(topology.node, "nft", "add", "table", "inet", return_route.NFT_TABLE)  # ours in the wrong family
    assert exists() is False
    nsexec(topology.node, "nft", "add", "table", "ip", return_route.NFT_TABLE)
    assert exists() is True
