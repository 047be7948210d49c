"""Transactions without a kernel: the first-install shortcut (no diff against nothing) and the
update path build the same table from empty, in both families and for every part of the layout;
and a change after either path is the same change."""

from __future__ import annotations

from usproxy.core.datapath import ServicePortState
from usproxy.offload.nftables.fake import FakeNft
from usproxy.offload.nftables.transaction import TableState, Transaction
from usproxy.model.types import ServicePortName

from tests.offload.helpers import ep, every_feature, spn, state
from tests.offload.nftables_fakes import UpdatePathOnly, install


def test_first_install_and_update_path_build_the_same_table_from_empty() -> None:
    fast, slow = FakeNft(), FakeNft()
    fast_tables: dict[int, TableState] = {}
    slow_tables: dict[int, TableState] = {}
    install(Transaction, dict(every_feature()), fast, fast_tables)
    install(UpdatePathOnly, dict(every_feature()), slow, slow_tables)
    assert set(fast.tables) == {4, 6}
    assert fast.dump() == slow.dump()
    assert fast_tables == slow_tables


def test_the_update_path_takes_over_identically_after_either_install() -> None:
    fast, slow = FakeNft(), FakeNft()
    fast_tables: dict[int, TableState] = {}
    slow_tables: dict[int, TableState] = {}
    install(Transaction, dict(every_feature()), fast, fast_tables)
    install(UpdatePathOnly, dict(every_feature()), slow, slow_tables)
    web, one = spn("web", "http"), spn("one")
    change: dict[ServicePortName, ServicePortState | None] = {
        web: state(web, "10.96.0.1", 80, [ep("10.244.2.1"), ep("10.244.4.1")], node_port=30080, service_type="NodePort"),
        one: None,
    }
    install(Transaction, change, fast, fast_tables)
    install(Transaction, change, slow, slow_tables)
    assert fast.dump() == slow.dump()
    assert "10.96.0.2 " not in fast.dump() and "10.244.4.1 . 8080" in fast.dump()
