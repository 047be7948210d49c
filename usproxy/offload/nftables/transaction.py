"""TableState and Transaction: what one family's table holds, and one atomic change of it.

A Transaction turns (previous, current) PortRules per ServicePort into nft Commands in an order
the kernel accepts; the TableState changes only after the kernel accepted them
(`Transaction.fold_into_state`), so a refused transaction leaves it as the kernel has it. Pure
(no I/O).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from usproxy.offload.nftables.commands import (
    NODEPORT_IPS,
    SERVICE_FRONTENDS,
    Command,
    Elem,
    HookSettings,
    base_commands,
    chain_commands,
    group_rules,
    own_chains,
    slot_commands,
)
from usproxy.offload.nftables.names import (
    FIREWALL_MAP,
    GROUP_CHAIN,
    Kind,
    addr_type,
    affinity_endpoint,
    comment_of,
    firewall_chain,
    group_chain,
    slot_map,
    verdict_map,
)
from usproxy.offload.nftables.pins import Pin, retimed
from usproxy.offload.nftables.rules import Frontend, PortRules, new_tuple, verdict_of, verdict_text
from usproxy.model.types import Family, Scope, ServicePortName


@dataclass
class TableState:
    """What one family's table holds (as far as usproxy put it there)."""

    family: Family
    base: bool = False
    slots: dict[Kind, int] = field(default_factory=lambda: {"ip": 0, "np": 0})
    groups: set[str] = field(default_factory=set)
    hairpin: Counter[str] = field(default_factory=Counter)
    nodeport_ips: frozenset[str] = frozenset()  # elements of set nodeport-ips
    rules: dict[ServicePortName, PortRules] = field(default_factory=dict)
    orphans: dict[str, set[str]] = field(default_factory=dict)  # map/set -> keys to delete (read back)
    # the local-traffic detector's "not from a pod" match in this family ("": none), for the
    # chains that mark only such traffic (gx-N; kube-proxy's IfNotLocalNFT)
    not_local: str = ""
    # its "from a pod" match ("": none), for the externalTrafficPolicy Local short-circuit
    if_local: str = ""
    # keys of `service-ips` that read back did not find in SERVICE_FRONTENDS (a table written
    # before that set existed); the next transaction adds them
    frontends_missing: frozenset[str] = frozenset()


class Transaction:
    """Commands for one atomic change of one family's table, in an order the kernel accepts:
    element deletes, chain flushes, chain and set deletes, then creations and element adds.
    `fold_into_state()` folds the change into the TableState, once the kernel accepted it."""

    # A ServicePort installed for the first time skips the diff against nothing: the common case
    # of a cold sync of 10,000 Services. tests/offload/test_nftables_transaction.py proves that
    # both paths build the same table from empty.
    first_install_shortcut: ClassVar[bool] = True

    def __init__(self, state: TableState, hooks: HookSettings = HookSettings()) -> None:
        self.state = state
        self.hooks = hooks
        self._nodeport_ips = state.nodeport_ips
        self.flushes: list[Command] = []
        self.drops: list[Command] = []
        self.creates: list[Command] = []
        self._slots = dict(state.slots)
        self._groups: set[str] = set()
        self._base = state.base
        self._hairpin: Counter[str] = Counter()
        self._rules: dict[ServicePortName, PortRules | None] = {}
        self._elem_del: defaultdict[str, list[Elem]] = defaultdict(list)
        self._elem_add: defaultdict[str, list[Elem]] = defaultdict(list)
        for m, keys in state.orphans.items():
            self._elem_del[m] += [Elem(k) for k in sorted(keys)]

    @property
    def family(self) -> Family:
        return self.state.family

    def commands(self) -> list[Command]:
        self._mirror_service_ips()
        dels = [Command("delete", "element", self.family, m, elems=tuple(e)) for m, e in self._elem_del.items() if e]
        adds = [Command("add", "element", self.family, m, elems=tuple(e)) for m, e in self._elem_add.items() if e]
        return [*dels, *self.flushes, *self.drops, *self.creates, *adds]

    def _mirror_service_ips(self) -> None:
        """SERVICE_FRONTENDS gets the keys `service-ips` gets and loses the keys it loses, besides
        what read back found it lacking (added) or holding beyond `service-ips` (orphans)."""
        m, dels, adds = SERVICE_FRONTENDS, self._elem_del.get("service-ips", []), self._elem_add.get("service-ips", [])
        gone = {e.key for e in self._elem_del.get(m, [])}
        gone |= {e.key for e in dels} - self.state.frontends_missing
        self._elem_del[m] = [Elem(k) for k in sorted(gone)]
        added = {e.key for e in adds} | (self.state.frontends_missing - {e.key for e in dels})
        self._elem_add[m] = [Elem(k) for k in sorted(added)]

    def retime(self, pins: Mapping[str, tuple[int, list[Pin]]]) -> None:
        """Write the pins of affinity sets whose ServicePort's timeout changes in this
        transaction again under the new timeout (`pins`: set -> (old timeout, pins); see
        NftablesDatapath._retimed_pins)."""
        for name, (old, lst) in pins.items():
            new = self._set_timeout(name)
            if new is None:
                continue
            for pin in lst:
                self._add_elem(name, Elem(retimed(pin, old, new)))

    def _set_timeout(self, name: str) -> int | None:
        """The timeout the affinity set `name` gets in this transaction (None: it is not kept)."""
        scopes: tuple[Scope, ...] = ("cluster", "external")
        for rules in self._rules.values():
            if rules is None:
                continue
            for scope in scopes:
                be = rules.backend(scope)
                if be.affinity and any(affinity_endpoint(rules.spn, scope, t.hostport()) == name for t in be.targets):
                    return be.affinity
        return None

    def _add_elem(self, m: str, e: Elem) -> None:
        self._elem_add[m].append(e)

    def _del_elem(self, m: str, key: str) -> None:
        self._elem_del[m].append(Elem(key))

    # -- shared structures
    def ensure_base(self) -> None:
        """Write the table, maps and hooked chains, and rewrite the shared slot and group chains
        the table already has (after a read back: whatever was flushed behind our back)."""
        if not self._base:
            self.creates[:0] = base_commands(self.family, self.hooks) + self._shared_chains()
            self._base = True

    @property
    def based(self) -> bool:
        """Whether the table's fixed part exists once this transaction is applied."""
        return self._base

    def set_nodeport_ips(self, wanted: frozenset[str]) -> None:
        """Make set nodeport-ips hold exactly `wanted` (addresses as nft prints them); the table's
        fixed part must exist (`based`)."""
        for ip in sorted(self._nodeport_ips - wanted):
            self._del_elem(NODEPORT_IPS, ip)
        for ip in sorted(wanted - self._nodeport_ips):
            self._add_elem(NODEPORT_IPS, Elem(ip))
        self._nodeport_ips = wanted

    def _shared_chains(self) -> list[Command]:
        cmds = [c for kind in ("ip", "np") for i in range(self.state.slots[kind])
                for c in slot_commands(self.family, kind, i)]
        for name in sorted(self.state.groups, key=lambda n: "m" in n):  # plain g-N before gm-N
            m = GROUP_CHAIN.match(name)
            if m:
                kind: Kind = "ip" if m.group(1) == "g" else "np"
                cmds += chain_commands(self.family, name, group_rules(
                    kind, int(m.group(3)), bool(m.group(2)), m.group(2) == "x", self.state.not_local))
        return cmds

    def _ensure_slots(self, kind: Kind, n: int) -> None:
        for i in range(self._slots[kind], n):
            self.creates += slot_commands(self.family, kind, i)
        self._slots[kind] = max(self._slots[kind], n)

    def _ensure_group(self, kind: Kind, n: int, masq: bool, nonlocal_only: bool = False) -> str:
        """Create chain g-N (npg-N; `m`: masquerade, `x`: masquerade what is not from a pod) and
        the slots it needs; its name."""
        name = group_chain(kind, n, masq, nonlocal_only)
        if name in self.state.groups or name in self._groups:
            return name
        if masq:
            self._ensure_group(kind, n, False)
        self._ensure_slots(kind, n)
        self._groups.add(name)
        self.creates += chain_commands(self.family, name, group_rules(kind, n, masq, nonlocal_only, self.state.not_local))
        return name

    # -- per ServicePort
    def update(self, prev: PortRules | None, new: PortRules | None) -> None:
        """Change the table from `prev` to `new` for one ServicePort (either may be None)."""
        if prev == new:
            return
        spn = (new or prev).spn  # type: ignore[union-attr]
        self.ensure_base()
        self._rules[spn] = new
        if prev is None and new is not None and self.first_install_shortcut:
            self._add_frontends(new)
            self._add_hairpin(new)
        else:
            self._frontends(prev, new)
            self._hairpin_delta(prev, new)
        # after the frontends: a short-circuit chain goes to the group chains they create
        if (prev and _owns_chains(prev)) or (new and _owns_chains(new)):
            self._own_chains(prev, new)
        if (prev and prev.fw_keys) or (new and new.fw_keys):
            self._firewall(prev, new)

    def _firewall(self, prev: PortRules | None, new: PortRules | None) -> None:
        """The ServicePort's `firewall-ips` elements: each guarded LB frontend goes to its firewall
        chain (which _own_chains writes; element deletes run before, adds after, chain changes)."""
        old = set(prev.fw_keys) if prev else set()
        cur = set(new.fw_keys) if new else set()
        for key in sorted(old - cur):
            self._del_elem(FIREWALL_MAP, key)
        if new is not None:
            verdict = f"goto {firewall_chain(new.spn)}"
            for key in sorted(cur - old):
                self._add_elem(FIREWALL_MAP, Elem(key, verdict, comment_of(new.spn, "cluster")))

    def _add_frontends(self, new: PortRules) -> None:
        """The common cold-start case (nothing installed before), without the diff."""
        adds = self._elem_add
        for fe in new.frontends:
            be = new.cluster if fe.scope == "cluster" else new.external
            kind: Kind = "ip" if fe.addr is not None else "np"
            key, n = fe.key(), len(be.targets)
            if n and not be.affinity:
                if not be.round_robin:
                    self._ensure_group(kind, n, be.masq, be.nonlocal_only)
                for i, t in enumerate(be.targets):
                    adds[slot_map(kind, i)].append(new_tuple(Elem, (key, t.nft(), None)))
            verdict = verdict_of(new, fe)
            value = verdict if verdict == "drop" else "goto " + verdict
            adds[verdict_map(kind, not be.serves())].append(new_tuple(Elem, (key, value, comment_of(new.spn, fe.scope))))

    def _add_hairpin(self, new: PortRules) -> None:
        """_hairpin_delta's cold-start case: every target is new for this ServicePort."""
        have, delta, adds = self.state.hairpin, self._hairpin, self._elem_add["hairpin"]
        for ip in new.hairpin:
            d = delta[ip] = delta.get(ip, 0) + 1
            if have.get(ip, 0) + d == 1:
                adds.append(new_tuple(Elem, (f"{ip} . {ip}", None, None)))

    def _frontends(self, prev: PortRules | None, new: PortRules | None) -> None:
        old_fes = {fe: prev for fe in prev.frontends} if prev else {}
        new_fes = {fe: new for fe in new.frontends} if new else {}
        for fe in old_fes.keys() | new_fes.keys():
            self._frontend(fe, prev if fe in old_fes else None, new if fe in new_fes else None)

    def _frontend(self, fe: Frontend, prev: PortRules | None, new: PortRules | None) -> None:
        p_be = prev.backend(fe.scope) if prev else None
        n_be = new.backend(fe.scope) if new else None
        p_verdict = verdict_of(prev, fe) if prev else None
        n_verdict = verdict_of(new, fe) if new else None
        if n_be is not None and n_be.targets and not n_be.affinity and not n_be.round_robin:
            # also when only the short-circuit chain's local verdict refers to the group
            self._ensure_group(fe.kind, len(n_be.targets), n_be.masq, n_be.nonlocal_only)
        if p_verdict != n_verdict or (prev and new and prev.spn != new.spn):
            if prev is not None:
                self._del_elem(verdict_map(fe.kind, not p_be.serves()), fe.key())  # type: ignore[union-attr]
            if new is not None:
                assert n_be is not None
                self._add_elem(verdict_map(fe.kind, not n_be.serves()),
                               Elem(fe.key(), verdict_text(new, fe), comment_of(new.spn, fe.scope)))
        p_slots = p_be.targets if p_be and not p_be.affinity else ()
        n_slots = n_be.targets if n_be and not n_be.affinity else ()
        for i in range(max(len(p_slots), len(n_slots))):
            old = p_slots[i] if i < len(p_slots) else None
            cur = n_slots[i] if i < len(n_slots) else None
            if old == cur:
                continue
            if old is not None:
                self._del_elem(slot_map(fe.kind, i), fe.key())
            if cur is not None:
                self._add_elem(slot_map(fe.kind, i), Elem(fe.key(), cur.nft()))

    def _own_chains(self, prev: PortRules | None, new: PortRules | None) -> None:
        """Create, rewrite or delete the ServicePort's own chains (affinity, round robin)."""
        old = own_chains(self.family, prev, self.state.not_local, self.state.if_local) if prev else {}
        cur = own_chains(self.family, new, self.state.not_local, self.state.if_local) if new else {}
        if old == cur:
            return
        if new is not None:
            for fe in new.frontends:
                be = new.backend(fe.scope)
                if be.round_robin and be.targets and not be.affinity:
                    self._ensure_slots(fe.kind, len(be.targets))
        ipx_type = addr_type(self.family)
        for name in old.keys() - cur.keys():
            self.flushes.append(Command("flush", "chain", self.family, name))
            self.drops.append(Command("delete", "chain", self.family, name))
            if name.startswith("ep-"):
                self.drops.append(Command("delete", "set", self.family, name))
        for name in cur.keys() & old.keys():
            if old[name] != cur[name]:  # unhook what it references before deleting those
                self.flushes.append(Command("flush", "chain", self.family, name))
        ordered = sorted(cur, key=lambda n: not n.startswith("ep-"))  # endpoint chains first
        for name in ordered:
            if name.startswith("ep-") and name not in old:
                self.creates.append(Command("add", "set", self.family, name, f"type {ipx_type}; flags timeout;"))
            if old.get(name) != cur[name]:
                self.creates += chain_commands(self.family, name, cur[name])

    def _hairpin_delta(self, prev: PortRules | None, new: PortRules | None) -> None:
        before = prev.hairpin if prev else frozenset()
        after = new.hairpin if new else frozenset()
        have, delta = self.state.hairpin, self._hairpin
        for ip in before - after:
            delta[ip] = delta.get(ip, 0) - 1
            if have.get(ip, 0) + delta[ip] == 0:
                self._del_elem("hairpin", f"{ip} . {ip}")
        for ip in after - before:
            delta[ip] = delta.get(ip, 0) + 1
            if have.get(ip, 0) + delta[ip] == 1:
                self._add_elem("hairpin", Elem(f"{ip} . {ip}"))

    def fold_into_state(self) -> None:
        """Make the TableState what the kernel holds after it accepted `commands()` (nothing is
        sent here: the datapath sends, and calls this only on success)."""
        s = self.state
        s.orphans = {}
        s.frontends_missing = frozenset()
        s.base = self._base
        s.nodeport_ips = self._nodeport_ips
        s.slots = self._slots
        s.groups |= self._groups
        for ip, d in self._hairpin.items():
            s.hairpin[ip] += d
            if s.hairpin[ip] <= 0:
                del s.hairpin[ip]
        for spn, r in self._rules.items():
            if r is None:
                s.rules.pop(spn, None)
            else:
                s.rules[spn] = r


def _owns_chains(rules: PortRules) -> bool:
    return bool(rules.cluster.affinity or rules.external.affinity or rules.cluster.round_robin
                or rules.external.round_robin or rules.external.short or rules.fw_keys)
