"""Fakes for the nftables datapath tests: a kernel conntrack that deletes nothing and records
what it was asked to delete, a Transaction that always installs by the diff (never the first-install
shortcut), and `install`, applying states to a FakeNft as the datapath does."""

from __future__ import annotations

from usproxy.core.datapath import ServicePortState
from usproxy.model.types import FAMILIES, ServicePortName
from usproxy.offload.kernel_conntrack import KernelConntrack
from usproxy.offload.nftables.fake import FakeNft
from usproxy.offload.nftables.rules import port_rules
from usproxy.offload.nftables.transaction import TableState, Transaction


class NoConntrack(KernelConntrack):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[set[tuple[str, int]]] = []

    async def delete_udp(self, *, reply_src: object = (), orig_dst: object = ()) -> int:
        self.deleted.append(set(orig_dst))  # type: ignore[call-overload]
        return 0


class UpdatePathOnly(Transaction):
    """A Transaction that installs new ServicePorts by the diff against nothing."""

    first_install_shortcut = False


def install(cls: type[Transaction], states: dict[ServicePortName, ServicePortState | None],
            nft: FakeNft, tables: dict[int, TableState]) -> None:
    """Apply `states` to `nft` as the datapath does: one Transaction per family, folded after."""
    for f in FAMILIES:
        tx = cls(tables.setdefault(f, TableState(f)))
        for name, st in states.items():
            prev = tx.state.rules.get(name)
            tx.update(prev, port_rules(st, f, prev, "node") if st is not None else None)
        nft.apply(tx.commands())
        tx.fold_into_state()
