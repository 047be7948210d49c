"""Removal of what the iptables datapath wrote, and nothing of anyone else's.

As kube-proxy's CleanupLeftovers (pkg/proxy/iptables/proxier.go): the entry jumps it inserted
into the built-in chains are deleted rule by rule, and its chains (names.owned: the top-level
KUBE-* chains, every per-ServicePort chain, the canaries) are flushed and deleted, all in one
iptables-restore --noflush per family, so another program's rules (Docker's, a firewall's,
kubelet's) are never named and stay as they are. Two exceptions keep them working:

- a chain that a rule of another program jumps to stays, with what it jumps to in turn (deleting
  it would fail, and that program relies on it; KUBE-MARK-MASQ is the usual one);
- when kubelet is there (its hint chains in mangle), KUBE-FIREWALL and its two jumps stay: they
  are kubelet's rules as much as kube-proxy's;
- the chains iptables and IPVS mode both name (shared.py) stay while the other mode holds them:
  after a switch of mode, the new one's first sync rewrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from usproxy.offload.iptables import names, shared
from usproxy.offload.iptables.jumps import BUILTIN, DATAPATH_JUMPS, Jump
from usproxy.offload.iptables.restore_input import TableWrite
from usproxy.offload.iptables.saved import SavedTable

TABLES = ("filter", "nat", "mangle")
_BUILTIN: dict[str, tuple[str, ...]] = {str(t): bases for t, bases in BUILTIN.items()}


def kubelet_present(tables: Mapping[str, SavedTable]) -> bool:
    mangle = tables.get("mangle")
    return mangle is not None and any(h in mangle.chains for h in names.KUBELET_HINTS)


def removal(tables: Mapping[str, SavedTable], owned: Callable[[str, str], bool] = names.owned,
            entry: Sequence[Jump] = DATAPATH_JUMPS, other: shared.Mode = "ipvs") -> list[TableWrite]:
    """The writes that remove the datapath's jumps and chains from one family's `tables`: the
    chains `owned(table, chain)` says are the mode's, and its `entry` jumps (another mode that
    writes KUBE-* chains, such as IPVS, passes its own, and "iptables" as the `other` mode)."""
    keep_firewall = kubelet_present(tables)
    out = []
    for name in TABLES:
        table = tables.get(name)
        if table is None:
            continue
        kept = shared.kept(name, table, other)
        ours = {c for c in table.user_chains() if owned(name, c)} - kept
        if keep_firewall and name == "filter":
            ours.discard(names.FIREWALL)
        ours -= _needed_by_others(table, ours, entry)
        theirs = shared.jump_texts(other) if kept else frozenset()  # the other mode's own jumps stay
        jumps = {j.text() for j in entry if j.table == name
                 and (j.target in ours or (j.target in kept and j.text() not in theirs))}
        edits = [f"-D {r.chain} {r.spec}" for b in _BUILTIN.get(name, ()) for r in table.in_chain(b)
                 if r.text() in jumps]
        out.append(TableWrite(name, delete=sorted(ours), edits=edits))
    return out


def _needed_by_others(table: SavedTable, ours: set[str], entry: Sequence[Jump]) -> set[str]:
    """Chains of `ours` that a rule outside them (not an entry jump of ours) jumps to, and
    those that such a chain jumps to in turn."""
    jumps = {j.text() for j in entry}
    needed = {r.target for r in table.rules
              if r.chain not in ours and r.target in ours and r.text() not in jumps}
    todo = [c for c in needed if c is not None]
    keep: set[str] = set()
    while todo:
        chain = todo.pop()
        if chain in keep:
            continue
        keep.add(chain)
        todo += [t for r in table.in_chain(chain) if (t := r.target) in ours]
    return keep


def describe(backend: str, family: int, tables: Mapping[str, SavedTable],
             owned: Callable[[str, str], bool] = names.owned, other: shared.Mode = "ipvs") -> str | None:
    """What of a mode one backend's family holds ("iptables-nft IPv4: 12 KUBE-* chains"), or
    None when nothing."""
    count = sum(1 for name in TABLES for c in (tables[name].user_chains() if name in tables else ())
                if owned(name, c) and c not in shared.kept(name, tables[name], other))
    return f"iptables-{backend} IPv{family}: {count} KUBE-* chains" if count else None
