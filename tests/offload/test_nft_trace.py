"""The tests' packet tracer reads every rule the nftables layout writes, and refuses text it
cannot read (so no rule is skipped silently)."""

from __future__ import annotations

import pytest

from usproxy.offload.nftables.fake import FakeNft, FakeTable
from usproxy.model.types import FAMILIES
from usproxy.offload.nftables.rules import port_rules
from usproxy.offload.nftables.transaction import TableState, Transaction

from tests.offload.helpers import every_feature
from tests.offload.nft_trace import steps, trace


@pytest.fixture
def nft() -> FakeNft:
    fake = FakeNft()
    for f in FAMILIES:
        tx = Transaction(TableState(f))
        for st in every_feature().values():
            tx.update(None, port_rules(st, f, None, "node"))
        fake.apply(tx.commands())
    return fake


def test_every_rule_of_every_chain_is_read(nft: FakeNft) -> None:
    rules = [r for t in nft.tables.values() for chain in t.chains.values() for r in chain]
    assert len(rules) > 60
    for rule in rules:
        assert steps(rule), rule


@pytest.mark.parametrize("rule", ["ip daddr 10.0.0.1 counter accept", "meta l4proto tcp ct mark 1 goto x"])
def test_text_it_cannot_read_fails(rule: str) -> None:
    with pytest.raises(AssertionError, match="cannot read"):
        steps(rule)


def test_a_key_it_cannot_read_fails_when_a_packet_looks_it_up() -> None:
    nft = FakeNft()
    nft.tables[4] = FakeTable(maps={"m": {}}, chains={"nat-prerouting": ["ct mark . th dport vmap @m"]})
    with pytest.raises(AssertionError, match="cannot read key 'ct mark'"):
        trace(nft, 4, "10.0.0.9", "10.0.0.1", "tcp", 80)


def test_traces_of_the_every_feature_table(nft: FakeNft) -> None:
    both = {"10.244.1.1:8080", "10.244.2.1:8080"}
    assert trace(nft, 4, "10.244.9.9", "10.96.0.1", "tcp", 80).targets == both
    assert trace(nft, 4, "10.244.9.9", "10.96.0.7", "tcp", 80).verdict == "reject"
    assert trace(nft, 4, "10.244.9.9", "10.96.0.10", "udp", 53).targets == {"10.244.1.1:53", "10.244.2.1:53"}
    local = trace(nft, 4, "203.0.113.1", "192.0.2.10", "tcp", 30003, local=["192.0.2.10"])
    assert local.targets == {"10.244.1.1:8080"} and not local.masq  # Local: this node's endpoint, no SNAT
    sticky = trace(nft, 4, "203.0.113.1", "192.0.2.10", "tcp", 30004, local=["192.0.2.10"])
    assert sticky.targets == sticky.masq == both  # affinity chain marks NodePort traffic
    v6 = trace(nft, 6, "2001:db8:244::9", "2001:db8:96::9", "tcp", 80)
    assert v6.targets == {"[2001:db8:244::1]:8080", "[2001:db8:244::2]:8080"}


def test_only_a_tcp_syn_is_translated_or_refused(nft: FakeNft) -> None:
    """A TCP segment picked up mid-stream (a connection the relay owns, whose conntrack entry
    is new) is neither DNATed nor rejected; a UDP datagram has no such mark and is translated."""
    assert trace(nft, 4, "10.244.9.9", "10.96.0.1", "tcp", 80, syn=False).verdict == "none"
    assert trace(nft, 4, "10.244.9.9", "10.96.0.7", "tcp", 80, syn=False).verdict == "none"
    assert trace(nft, 4, "10.244.9.9", "10.96.0.1", "tcp", 80).verdict == "dnat"
    assert trace(nft, 4, "10.244.9.9", "10.96.0.10", "udp", 53, syn=False).verdict == "dnat"
