"""FamilyRules: one family's rules as the datapath holds them, kept per ServicePort.

The generator (rules.py) gives a skeleton and one fragment per ServicePort; a Ruleset assembled
from all of them is what explain prints. A sync must not cost the work of all ServicePorts when
one changed (at 10,000 Services, assembling took seconds in Python), so each fragment is kept
with its rules already rendered per chain, and a sync regenerates only the fragments that
changed (all of them when what they all depend on changes: the node, the options, crossing into
large-cluster mode). What every sync still writes is what kube-proxy writes every sync: the filter
table and the nat table's top-level chains, whose rules are taken from every fragment (their
text, not rebuilt) in the canonical order `rules.ordered` gives: KUBE-SERVICES and KUBE-NODEPORTS
by Service name (the NodePort tail last), the other chains in ServicePortName order.

Invariant: `ruleset()` assembles exactly what `writes()` writes (a test compares them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from usproxy.core.datapath import ServicePortState
from usproxy.model.service_set import FamilyPort, Node
from usproxy.model.types import Family
from usproxy.model.types import ServicePortName
from usproxy.offload.iptables import names
from usproxy.offload.iptables.family_ports import family_port_of
from usproxy.offload.iptables.jumps import Table
from usproxy.offload.iptables.restore_input import TableWrite
from usproxy.offload.iptables.rules import (SORTED_CHAINS, Context, Options, Ruleset, assemble, chain_order,
                                            context, port_ruleset, service_key, skeleton)

TABLES: tuple[Table, ...] = ("filter", "nat")
CHUNK = 1000  # ServicePorts whose own chains one restore input writes, beyond which they go first
ChainKey = tuple[Table, str]


@dataclass(frozen=True, slots=True)
class Fragment:
    """One ServicePort's rules: the generator's, and their text per chain."""

    ruleset: Ruleset
    lines: dict[ChainKey, tuple[str, ...]]
    own: frozenset[str]  # the nat chains that are its alone (KUBE-SVC-, -SVL-, -EXT-, -FW-, -SEP-)
    shared: tuple[tuple[ChainKey, tuple[str, ...]], ...]  # its rules in the top-level chains
    endpoints: int  # what it adds to the large-cluster count
    key: tuple[int, str]  # its place in the sorted chains (every rule of it there has the same)


def fragment(ctx: Context, fp: FamilyPort) -> Fragment:
    rs = port_ruleset(ctx, fp)
    lines: dict[ChainKey, list[str]] = {}
    for r in rs.rules:
        lines.setdefault((r.table, r.chain), []).append(r.text())
    key = next((service_key(r) for r in rs.rules if r.chain in SORTED_CHAINS), (0, ""))
    own = frozenset(c for c in rs.chains["nat"] if names.is_service_chain(c))
    shared = tuple((k, tuple(v)) for k, v in lines.items() if k[1] not in own)
    return Fragment(rs, {k: tuple(v) for k, v in lines.items()}, own, shared, len(fp.endpoints), key)


@dataclass
class FamilyRules:
    """The rules of one family after a sync (an empty one before the first)."""

    family: Family
    fragments: dict[ServicePortName, Fragment] = field(default_factory=dict)
    ctx: Context | None = None
    base: Ruleset | None = None  # the skeleton of `ctx`
    total: int = 0  # endpoints of every fragment (large-cluster mode)
    chains: set[str] = field(default_factory=set)  # the per-ServicePort nat chains of the fragments

    def updated(self, node: Node, opts: Options, installed: Mapping[ServicePortName, ServicePortState],
                changed: Iterable[ServicePortName]) -> tuple[FamilyRules, set[ServicePortName] | None]:
        """These rules after `changed` (their states in `installed`, absent: removed), and the
        ServicePorts whose fragment changed (None: every one, the context changed)."""
        fps = {spn: _port(installed.get(spn), self.family) for spn in changed}
        total = self.total + sum((len(fp.endpoints) if fp else 0) - self._endpoints(spn) for spn, fp in fps.items())
        ctx = context(node, self.family, opts, total)
        if ctx != self.ctx:
            fps = {spn: _port(installed.get(spn), self.family) for spn in installed.keys() | self.fragments.keys()}
        out = FamilyRules(self.family, dict(self.fragments), ctx, self.base if ctx == self.ctx else skeleton(ctx),
                          total, set(self.chains))
        redone = set()
        for spn, fp in fps.items():
            old = out.fragments.pop(spn, None)
            new = fragment(ctx, fp) if fp is not None else None
            if new is not None:
                out.fragments[spn] = new
            if (old is None) != (new is None) or (old is not None and new is not None and new.ruleset != old.ruleset):
                redone.add(spn)
                out.chains -= old.own if old else frozenset()
                out.chains |= new.own if new else frozenset()
        return out, (None if ctx != self.ctx else {s for s in redone if s in fps})

    def _endpoints(self, spn: ServicePortName) -> int:
        f = self.fragments.get(spn)
        return f.endpoints if f is not None else 0

    def writes(self, rewrite: set[ServicePortName] | None, stale: Iterable[str],
               chunk: int | None = CHUNK) -> list[list[TableWrite]]:
        """The restore inputs of a sync, in order: the filter table and the nat top-level chains
        from every fragment, the own chains of `rewrite` (None: of every fragment) and `stale`
        nat chains deleted. Many own chains are written first, CHUNK ServicePorts per input:
        iptables-nft-restore's time grows with the square of the chains one input names (10,000
        Services in one input: 12 s of CPU; in chunks of 2,000: 0.7 s each, measured), and each
        chunk is whole ServicePorts, whose chains only refer to each other and to KUBE-MARK-MASQ
        (written with them), so every state between two inputs serves each ServicePort either
        as before or as after. The last input switches KUBE-SERVICES and deletes what is stale.
        `chunk` None: one input (iptables-legacy replaces a whole table at every COMMIT, so there
        chunks cost more than they save: 10,000 Services took 10 s chunked, 3 s in one input)."""
        assert self.base is not None
        order = sorted(self.fragments)
        own = order if rewrite is None else sorted(rewrite & self.fragments.keys())
        chunks = [own[i:i + chunk] for i in range(0, len(own), chunk)] if chunk and len(own) > chunk else []
        out = [[self._own_write(part, with_masq=True)] for part in chunks]
        shared = self._shared(order)
        last = []
        for table in TABLES:
            w = TableWrite(table, delete=sorted(stale) if table == "nat" else [])
            for chain in chain_order(self.base.chains[table]):
                w.chains.append(chain)
                w.rules += shared.get((table, chain), [])
            if table == "nat" and not chunks:
                own_w = self._own_write(own)
                w.chains += own_w.chains
                w.rules += own_w.rules
            last.append(w)
        return [*out, last]

    def _own_write(self, spns: Iterable[ServicePortName], with_masq: bool = False) -> TableWrite:
        """The nat chains that are these ServicePorts' own (and KUBE-MARK-MASQ, which they use)."""
        w = TableWrite("nat")
        if with_masq and self.base is not None:
            w.chains.append(names.MARK_MASQ)
            w.rules += [r.text() for r in self.base.in_chain("nat", names.MARK_MASQ)]
        for spn in spns:
            f = self.fragments[spn]
            for chain in chain_order(sorted(f.own)):
                w.chains.append(chain)
                w.rules += f.lines.get(("nat", chain), ())
        return w

    def _shared(self, order: list[ServicePortName]) -> dict[ChainKey, list[str]]:
        """Every top-level chain's rules: the skeleton's and every fragment's (one pass over the
        fragments), in canonical order."""
        assert self.base is not None
        entries: dict[ChainKey, list[tuple[tuple[int, str], tuple[str, ...]]]] = {}
        for r in self.base.rules:
            entries.setdefault((r.table, r.chain), []).append((service_key(r), (r.text(),)))
        for spn in order:
            f = self.fragments[spn]
            for key, lines in f.shared:
                entries.setdefault(key, []).append((f.key, lines))
        out = {}
        for key, parts in entries.items():
            if key[1] in SORTED_CHAINS:
                parts.sort(key=lambda e: e[0])
            out[key] = [line for _, lines in parts for line in lines]
        return out

    def ruleset(self) -> Ruleset | None:
        """The assembled Ruleset (what explain prints for the same ServicePorts)."""
        if self.ctx is None:
            return None
        return assemble(self.ctx, [self.fragments[s].ruleset for s in sorted(self.fragments)])


def _port(st: ServicePortState | None, family: Family) -> FamilyPort | None:
    return family_port_of(st, family) if st is not None else None
