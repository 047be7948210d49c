"""The nftables layout: what usproxy's tables hold per ServicePort, and the commands that change it.

Pure (no I/O): `port_rules()` turns a ServicePortState into PortRules for one IP family,
`Transaction` turns (previous, current) PortRules into element adds and deletes, and `Command`s
render as nft syntax for libnftables. The same Command objects drive `FakeNft` in
nftables_fake.py, so unit tests trace packets through exactly what the kernel gets.

Layout, one table per family (`ip usproxy`, `ip6 usproxy`), as kube-proxy's nftables mode
(pkg/proxy/nftables/proxier.go: the `service-ips` / `service-nodeports` verdict maps keyed by
address . protocol . port, `no-endpoint-services` with `reject`, masquerade by packet mark) but with
no per-ServicePort chains for the common case, because per-service chains and anonymous vmaps are
what made kube-proxy's layout take 66-75 s for 10,000 Services here (../shared/PLATFORM.md):

- a frontend (ClusterIP/externalIP . proto . port, or NodePort proto . port) with N endpoints maps
  in `service-ips` / `service-nodeports` to `goto g-N` (`npg-N` for NodePorts; `gm-N`/`npgm-N` set
  the masquerade mark first). Chain g-N is one rule `numgen random mod N vmap { i : goto s-i }`.
- chain s-i is one rule `dnat to <frontend key> map @slot-i`; map slot-i holds, per frontend, its
  i-th endpoint. So a frontend with N endpoints has one verdict element and N slot elements, and
  the chains are shared by all ServicePorts: their number is the largest N, not the Service count.
- an endpoint change touches only the changed slots (a removed endpoint's slot takes the last
  one, then the verdict moves from g-N to g-(N-1)): cost proportional to the change.
- sessionAffinity ClientIP uses per-ServicePort chains as kube-proxy: per endpoint a set of client
  addresses with a timeout, checked before the numgen choice and refreshed on each new connection.
- lb-policy roundRobin (annotation usproxy.io/lb-policy) also gets a chain of its own per
  ServicePort (`rr-<hash>-<scope>`): `numgen inc mod N vmap { i : goto s-i }`, whose counter is
  that rule's alone. Only annotated ServicePorts pay for a chain; the rest share g-N and pick
  with `numgen random`, as kube-proxy's nftables mode.
- frontends without endpoints are in `no-endpoint-services` / `no-endpoint-nodeports`, which the
  filter hooks turn into `reject` (TCP reset, ICMP port unreachable).
- `hairpin` holds endpoint . endpoint pairs: a connection DNATed back to its own source is
  masqueraded (field case C24). Only endpoints that may be on this node get one (see port_rules). `ct state invalid drop` on forward (C25), as kube-proxy.

Every verdict element carries the ServicePortName as its comment, so `read back` (nftables_readback)
can attribute kernel state to ServicePorts after a restart.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
import socket
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from usproxy.datapath import ServicePortState
from usproxy.endpoint import Endpoint
from usproxy.types import IPAddress, ServicePortName

Family: TypeAlias = Literal[4, 6]
Scope: TypeAlias = Literal["cluster", "external"]
Kind: TypeAlias = Literal["ip", "np"]

TABLE = "usproxy"
FAMILIES: tuple[Family, ...] = (4, 6)
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit
COMMENT_MAX = 127  # nft element comments hold at most 128 bytes with the NUL


def nft_family(family: Family) -> str:
    return "ip" if family == 4 else "ip6"


def addr_type(family: Family) -> str:
    return "ipv4_addr" if family == 4 else "ipv6_addr"


_TEXT: dict[int, str] = {}
# Builds a NamedTuple from a tuple of every field without NamedTuple's Python-level __new__: a
# cold sync of 10,000 Services makes ~100,000 Targets, Frontends, Backends and Elems.
_new = tuple.__new__


def ip_text(ip: IPAddress) -> str:
    """str(ip), cached by the address's integer: ipaddress formats (and hashes) in Python, which
    dominated a cold sync of 10,000 Services. IPv6 keys are negative so families never collide."""
    num = int(ip)
    v4 = isinstance(ip, ipaddress.IPv4Address)
    key = num if v4 else -1 - num
    text = _TEXT.get(key)
    if text is None:
        if len(_TEXT) > 1 << 18:
            _TEXT.clear()
        text = _TEXT[key] = socket.inet_ntoa(num.to_bytes(4, "big")) if v4 else str(ip)
    return text


def family_of(ip: IPAddress) -> Family:
    return 4 if isinstance(ip, ipaddress.IPv4Address) else 6


def norm_ip(text: str) -> str:
    """An address in the form str(ipaddress) gives (as nft prints it): the layout's keys."""
    return str(ipaddress.ip_address(text))


def short_hash(text: str) -> str:
    """8 base32 characters of sha256, as kube-proxy's hashAndTruncate prefix."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest())[:8].decode().lower()


# -- values --------------------------------------------------------------------------------------
class Target(NamedTuple):
    """One endpoint address as the kernel sees it (conditions are the manager's business).
    Addresses are text here: the layout only renders them, and a cold sync of 10,000 Services
    would otherwise spend most of its time hashing and formatting ipaddress objects. Target,
    Frontend and Backend are NamedTuples (immutable values, built in C): a cold sync makes
    tens of thousands of them, and frozen dataclasses took a third of its time."""

    ip: str
    port: int

    def nft(self) -> str:
        return f"{self.ip} . {self.port}"

    def hostport(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


class Frontend(NamedTuple):
    """Where a ServicePort is reached: an address . proto . port, or a NodePort (addr None)."""

    addr: str | None
    proto: str
    port: int
    scope: Scope

    @property
    def kind(self) -> Kind:
        return "np" if self.addr is None else "ip"

    def key(self) -> str:
        if self.addr is None:
            return f"{self.proto} . {self.port}"
        return f"{self.addr} . {self.proto} . {self.port}"


class Backend(NamedTuple):
    """How one scope (cluster or external traffic) picks endpoints: targets in slot order."""

    targets: tuple[Target, ...] = ()
    masq: bool = False
    affinity: int = 0  # ClientIP timeout in seconds; 0: no affinity
    round_robin: bool = False  # lb-policy roundRobin: `numgen inc` in chains of its own


_EMPTY = Backend()


class PortRules(NamedTuple):
    """Everything one ServicePort holds in one family's table (a NamedTuple, as Target)."""

    spn: ServicePortName
    family: Family
    frontends: tuple[Frontend, ...]
    cluster: Backend
    external: Backend
    # endpoint addresses that may be clients of this ServicePort through this node (port_rules);
    # kept beside the targets, not in them, so a read back that can only guess it per address
    # never makes slot elements look changed
    hairpin: frozenset[str] = frozenset()

    def backend(self, scope: Scope) -> Backend:
        return self.cluster if scope == "cluster" else self.external

    def targets(self) -> set[Target]:
        return {*self.cluster.targets, *self.external.targets}

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints the kernel serves (cluster and external), for read back."""
        return tuple(sorted(Endpoint(ipaddress.ip_address(t.ip), t.port) for t in self.targets()))


# -- names -----------------------------------------------------------------------------------------
def verdict_map(kind: Kind, empty: bool) -> str:
    if empty:
        return "no-endpoint-services" if kind == "ip" else "no-endpoint-nodeports"
    return "service-ips" if kind == "ip" else "service-nodeports"


def slot_map(kind: Kind, i: int) -> str:
    return f"slot-{i}" if kind == "ip" else f"np-slot-{i}"


def slot_chain(kind: Kind, i: int) -> str:
    return f"s-{i}" if kind == "ip" else f"nps-{i}"


GROUP_CHAIN = re.compile(r"^(g|npg)(m?)-(\d+)$")  # kind, masquerade, endpoint count


def group_chain(kind: Kind, n: int, masq: bool) -> str:
    return f"{'g' if kind == 'ip' else 'npg'}{'m' if masq else ''}-{n}"


def affinity_chain(spn: ServicePortName, scope: Scope) -> str:
    return f"aff-{short_hash(spn.key())}-{scope[0]}"


def rr_chain(spn: ServicePortName, scope: Scope, kind: Kind) -> str:
    """The round-robin chain of one ServicePort's scope, per frontend kind (ClusterIP/external
    IPs, or NodePort: their slot chains differ)."""
    return f"rr-{short_hash(spn.key())}-{scope[0]}{'' if kind == 'ip' else 'n'}"


def affinity_endpoint(spn: ServicePortName, scope: Scope, t: Target) -> str:
    """Name of the endpoint chain and of its client-address set (they share it)."""
    return f"ep-{short_hash(spn.key())}-{scope[0]}-{short_hash(t.hostport())}"


def verdict_of(rules: PortRules, fe: Frontend) -> str:
    """The chain a frontend's verdict element jumps to (`goto <chain>`)."""
    be = rules.backend(fe.scope)
    if not be.targets:
        return "reject-chain"
    if be.affinity:
        return affinity_chain(rules.spn, fe.scope)
    if be.round_robin:
        return rr_chain(rules.spn, fe.scope, fe.kind)
    return group_chain(fe.kind, len(be.targets), be.masq)


# -- from the model --------------------------------------------------------------------------------
def assign_slots(previous: Sequence[Target], wanted: Iterable[Target]) -> tuple[Target, ...]:
    """Slot order for `wanted` that moves as few targets as possible from `previous`.

    Remaining targets keep their slots; a freed slot takes a new target, or else the last target
    (so slots stay dense 0..N-1); new targets left over are appended in sorted order.
    """
    if not previous:
        return tuple(sorted(wanted))
    want = set(wanted)
    fresh = sorted(want - set(previous), reverse=True)
    slots: list[Target | None] = [t if t in want else (fresh.pop() if fresh else None) for t in previous]
    while None in slots:
        last = slots.pop()
        if last is not None:
            slots[slots.index(None)] = last
    return (*(t for t in slots if t is not None), *reversed(fresh))


def _targets(eps: Iterable[Endpoint], v4: bool, node: str | None, hairpin: set[str]) -> list[Target]:
    """Targets of `eps` in one family; adds to `hairpin` the addresses that may be on this node."""
    out = []
    for ep in eps:
        if isinstance(ep.ip, ipaddress.IPv4Address) is v4:
            out.append(t := _new(Target, (ip_text(ep.ip), ep.port)))
            if node is None or ep.node_name is None or ep.node_name == node:
                hairpin.add(t.ip)
    return out


def _slots(previous: Sequence[Target], wanted: list[Target]) -> tuple[Target, ...]:
    if not previous:
        return tuple(sorted(set(wanted))) if len(wanted) > 1 else tuple(wanted)
    return assign_slots(previous, wanted)


_PROTO = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}


def port_rules(state: ServicePortState, family: Family, previous: PortRules | None,
               node_name: str | None = None) -> PortRules | None:
    """What `state` needs in `family`'s table, keeping `previous` slot positions. None: nothing
    (the ServicePort has no ClusterIP in this family).

    `node_name` is this node's: endpoints on other nodes (EndpointSlice nodeName set and not
    ours) get no hairpin element. Their own traffic to the Service is DNATed on their own node, and
    what reaches this node from them as external traffic is masqueraded anyway (as Cilium, which
    handles hairpin for local endpoints only; kube-proxy marks every endpoint). Endpoints without a
    nodeName, or every endpoint when the agent has no node name, may be local and get one."""
    sp = state.service_port
    v4 = family == 4
    cluster_ips = [ip for ip in sp.cluster_ips if isinstance(ip, ipaddress.IPv4Address) is v4]
    if not cluster_ips:
        return None
    proto, port = _PROTO[sp.name.protocol], sp.port
    fes = [_new(Frontend, (ip_text(ip), proto, port, "cluster")) for ip in cluster_ips]
    if sp.external_ips or sp.load_balancer_ips:
        fes += [Frontend(ip_text(ip), proto, port, "external") for ip in sp.external_ips_all()
                if isinstance(ip, ipaddress.IPv4Address) is v4]
    if sp.node_port:
        fes.append(Frontend(None, proto, sp.node_port, "external"))
    affinity = sp.affinity_timeout if sp.session_affinity == "ClientIP" else 0
    rr = sp.lb_policy == "roundRobin"
    hairpin: set[str] = set()
    cluster = _new(Backend, (_slots(previous.cluster.targets if previous else (),
                                    _targets(state.cluster_endpoints, v4, node_name, hairpin)), False, affinity, rr))
    external = _EMPTY
    if len(fes) > len(cluster_ips):  # externalIPs, LoadBalancer IPs or a NodePort
        masq = sp.external_traffic_policy == "Cluster"
        external = Backend(_slots(previous.external.targets if previous else (), _targets(state.external_endpoints, v4, node_name, hairpin)),
                           masq, affinity, rr)
    if len(fes) > 1:
        fes.sort(key=frontend_order)
    return _new(PortRules, (sp.name, family, tuple(fes), cluster, external, frozenset(hairpin)))


def frontend_order(fe: Frontend) -> tuple[int, str, int]:
    """PortRules.frontends order: addresses first (by text, then port), then NodePorts."""
    return (0 if fe.addr is not None else 1, fe.addr or "", fe.port)


EXTERNAL_SUFFIX = " external"


def comment_of(spn: ServicePortName, scope: Scope) -> str:
    """The verdict element's comment: the ServicePortName, and which traffic the frontend takes."""
    suffix = EXTERNAL_SUFFIX if scope == "external" else ""
    return spn.key()[:COMMENT_MAX - len(suffix)] + suffix


def parse_comment(comment: str) -> tuple[ServicePortName | None, Scope]:
    """Inverse of comment_of."""
    if comment.endswith(EXTERNAL_SUFFIX):
        return parse_spn(comment[: -len(EXTERNAL_SUFFIX)]), "external"
    return parse_spn(comment), "cluster"


def parse_spn(comment: str) -> ServicePortName | None:
    """Inverse of ServicePortName.key(): "ns/name:port/TCP" or "ns/name/TCP"."""
    try:
        base, proto = comment.rsplit("/", 1)
        namespace, rest = base.split("/", 1)
    except ValueError:
        return None
    if proto not in ("TCP", "UDP", "SCTP"):
        return None
    name, _, port = rest.partition(":")
    return ServicePortName(namespace, name, port, proto)  # type: ignore[arg-type]




# -- commands ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: its nft text and, for the tracer, what it does (`op`, `args`)."""

    text: str
    op: str = "raw"
    args: tuple[str, ...] = ()


class Elem(NamedTuple):
    """One set or map element in nft syntax (a NamedTuple for the same reason as Target)."""

    key: str
    value: str | None = None
    comment: str | None = None

    def nft(self) -> str:
        c = f' comment "{self.comment}"' if self.comment is not None else ""
        return f"{self.key}{c}" if self.value is None else f"{self.key}{c} : {self.value}"


@dataclass(frozen=True, slots=True)
class Command:
    """One nft command in one family's table. `verb`: add/delete/flush; `obj`: table, map, set,
    chain, rule, element. `spec` is the type/hook text; `rule` for rules; `elems` for elements."""

    verb: str
    obj: str
    family: Family
    name: str = ""
    spec: str = ""
    rule: Rule | None = None
    elems: tuple[Elem, ...] = ()

    def nft(self) -> str:
        where = f"{nft_family(self.family)} {TABLE}"
        if self.obj == "table":
            return f"{self.verb} table {where}"
        if self.obj == "element":
            if self.verb == "delete":
                body = ", ".join([k for k, _, _ in self.elems])
            else:  # Elem.nft() inlined: a cold sync renders 50,000 elements
                body = ", ".join([k if v is None and c is None else f"{k} : {v}" if c is None else
                                  f'{k} comment "{c}"' + ("" if v is None else f" : {v}") for k, v, c in self.elems])
            return f"{self.verb} element {where} {self.name} {{ {body} }}"
        if self.obj == "rule":
            assert self.rule is not None
            return f"add rule {where} {self.name} {self.rule.text}"
        spec = f" {{ {self.spec} }}" if self.spec and self.verb == "add" else ""
        return f"{self.verb} {self.obj} {where} {self.name}{spec}"


def render(commands: Iterable[Command]) -> str:
    return "\n".join(c.nft() for c in commands) + "\n"


# -- the fixed part ------------------------------------------------------------------------------------
def _ipx(family: Family) -> str:
    return nft_family(family)


def _not_localhost(family: Family) -> str:
    return "ip daddr != 127.0.0.0/8" if family == 4 else "ip6 daddr != ::1"


def base_commands(family: Family) -> list[Command]:
    """Table, verdict maps, hairpin set and the hooked chains; flushed and rewritten as a whole so
    a restart after an upgrade converges. Maps are only added (idempotent), never emptied."""
    ipx, at = _ipx(family), addr_type(family)
    key3 = f"{ipx} daddr . meta l4proto . th dport"
    np_key = f"fib daddr type local {_not_localhost(family)} meta l4proto . th dport"
    cmds = [Command("add", "table", family)]
    for name in ("service-ips", "no-endpoint-services"):
        cmds.append(Command("add", "map", family, name, f"type {at} . inet_proto . inet_service : verdict;"))
    for name in ("service-nodeports", "no-endpoint-nodeports"):
        cmds.append(Command("add", "map", family, name, "type inet_proto . inet_service : verdict;"))
    cmds.append(Command("add", "set", family, "hairpin", f"type {at} . {at};"))
    chains: list[tuple[str, str, list[Rule]]] = [
        ("reject-chain", "", [Rule("meta l4proto tcp reject with tcp reset", "reject"), Rule("reject", "reject")]),
        ("services", "", [Rule(f"{key3} vmap @service-ips", "vmap", ("ip", "service-ips")),
                          Rule(f"{np_key} vmap @service-nodeports", "vmap", ("np", "service-nodeports"))]),
        ("endpoints-check", "", [Rule(f"{key3} vmap @no-endpoint-services", "vmap", ("ip", "no-endpoint-services")),
                                 Rule(f"{np_key} vmap @no-endpoint-nodeports", "vmap", ("np", "no-endpoint-nodeports"))]),
        ("nat-prerouting", "type nat hook prerouting priority -100; policy accept;", [Rule("jump services", "jump", ("services",))]),
        ("nat-output", "type nat hook output priority -100; policy accept;", [Rule("jump services", "jump", ("services",))]),
        ("nat-postrouting", "type nat hook postrouting priority 100; policy accept;", [
            Rule(f"meta mark & {MASQ_MARK:#x} == {MASQ_MARK:#x} meta mark set meta mark ^ {MASQ_MARK:#x} masquerade fully-random"),
            Rule(f"ct status dnat {ipx} saddr . {ipx} daddr @hairpin masquerade fully-random")]),
        ("filter-input", "type filter hook input priority -110; policy accept;", [Rule("ct state new jump endpoints-check")]),
        ("filter-forward", "type filter hook forward priority -110; policy accept;", [
            Rule("ct state invalid drop"), Rule("ct state new jump endpoints-check")]),
        ("filter-output", "type filter hook output priority -110; policy accept;", [Rule("ct state new jump endpoints-check")]),
    ]
    for name, hook, rules in chains:
        cmds += chain_commands(family, name, rules, hook=hook)
    return cmds


def chain_commands(family: Family, name: str, rules: Sequence[Rule], *, hook: str = "") -> list[Command]:
    """Create (or rewrite) a chain with exactly `rules`: add, flush, add each rule."""
    cmds = [Command("add", "chain", family, name, hook)]
    cmds.append(Command("flush", "chain", family, name))
    cmds += [Command("add", "rule", family, name, rule=r) for r in rules]
    return cmds


def slot_commands(family: Family, kind: Kind, i: int) -> list[Command]:
    ipx, at = _ipx(family), addr_type(family)
    if kind == "ip":
        spec = f"type {at} . inet_proto . inet_service : {at} . inet_service;"
        key = f"{ipx} daddr . meta l4proto . th dport"
    else:
        spec = f"type inet_proto . inet_service : {at} . inet_service;"
        key = "meta l4proto . th dport"
    m = slot_map(kind, i)
    return [Command("add", "map", family, m, spec),
            *chain_commands(family, slot_chain(kind, i), [Rule(f"dnat {ipx} to {key} map @{m}", "dnat-map", (kind, m))])]


def group_rules(kind: Kind, n: int, masq: bool) -> list[Rule]:
    if masq:
        return [Rule(f"meta mark set meta mark | {MASQ_MARK:#x}", "mark"),
                Rule(f"goto {group_chain(kind, n, False)}", "goto", (group_chain(kind, n, False),))]
    if n == 1:
        return [Rule(f"goto {slot_chain(kind, 0)}", "goto", (slot_chain(kind, 0),))]
    targets = tuple(slot_chain(kind, i) for i in range(n))
    body = ", ".join(f"{i} : goto {t}" for i, t in enumerate(targets))
    return [Rule(f"numgen random mod {n} vmap {{ {body} }}", "numgen", targets)]


def pick_rules(chains: Sequence[str], round_robin: bool) -> list[Rule]:
    """Go to one of `chains`: `numgen random`, or `numgen inc` (a counter of this rule's own,
    so round robin per ServicePort) for lb-policy roundRobin."""
    if len(chains) == 1:
        return [Rule(f"goto {chains[0]}", "goto", (chains[0],))]
    body = ", ".join(f"{i} : goto {c}" for i, c in enumerate(chains))
    mode = "inc" if round_robin else "random"
    return [Rule(f"numgen {mode} mod {len(chains)} vmap {{ {body} }}", "numgen-inc" if round_robin else "numgen", tuple(chains))]


def rr_rules(rules: PortRules, scope: Scope) -> dict[str, list[Rule]]:
    """lb-policy roundRobin without affinity: per frontend kind of `scope` a chain of this
    ServicePort's own that marks for masquerade when needed and picks a slot chain in turn."""
    be = rules.backend(scope)
    if not be.round_robin or be.affinity or not be.targets:
        return {}
    head = [Rule(f"meta mark set meta mark | {MASQ_MARK:#x}", "mark")] if be.masq else []
    kinds = sorted({fe.kind for fe in rules.frontends if fe.scope == scope})
    return {rr_chain(rules.spn, scope, k): head + pick_rules([slot_chain(k, i) for i in range(len(be.targets))], True)
            for k in kinds}


def own_chains(family: Family, rules: PortRules) -> dict[str, list[Rule]]:
    """The chains that belong to one ServicePort (affinity and round robin), by name."""
    out: dict[str, list[Rule]] = {}
    for scope in ("cluster", "external"):
        if _has_affinity(rules, scope):
            out.update(affinity_rules(family, rules, scope))
        out.update(rr_rules(rules, scope))
    return out


def affinity_rules(family: Family, rules: PortRules, scope: Scope) -> dict[str, list[Rule]]:
    """kube-proxy's affinity: a set of client addresses per endpoint, checked before the random
    choice; the endpoint chain refreshes it (per-element timeout) and DNATs."""
    ipx = _ipx(family)
    be = rules.backend(scope)
    proto = rules.spn.protocol.lower()
    names = [affinity_endpoint(rules.spn, scope, t) for t in be.targets]
    head = [Rule(f"meta mark set meta mark | {MASQ_MARK:#x}", "mark")] if be.masq else []
    checks = [Rule(f"{ipx} saddr @{n} goto {n}", "affinity-check", (n, n)) for n in names]
    out = {affinity_chain(rules.spn, scope): head + checks + pick_rules(names, be.round_robin)}
    for n, t in zip(names, be.targets):
        addr = f"[{t.ip}]" if family == 6 else t.ip
        out[n] = [Rule(f"update @{n} {{ {ipx} saddr timeout {be.affinity}s }}", "affinity-update", (n, str(be.affinity))),
                  Rule(f"meta l4proto {proto} dnat {ipx} to {addr}:{t.port}", "dnat", (t.ip, str(t.port)))]
    return out


class Pin(NamedTuple):
    """One client address in an endpoint's affinity set: its timeout and what is left of it (s)."""

    client: str
    timeout: float
    expires: float


_DURATION = re.compile(r"(\d+)(ms|d|h|m|s)")
_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PIN = re.compile(r"([0-9a-fA-F:.]+) timeout (\S+?) expires (\S+?)(?=[,\s}]|$)")


def _duration(text: str) -> float:
    return sum(int(n) * _SECONDS[u] for n, u in _DURATION.findall(text))


def parse_pins(listing: str) -> list[Pin]:
    """The elements of `nft list set` text output ("10.0.0.1 timeout 5s expires 4s992ms")."""
    return [Pin(m.group(1), _duration(m.group(2)), _duration(m.group(3))) for m in _PIN.finditer(listing)]


def retimed(pin: Pin, old: int, new: int) -> str:
    """The element written again under the `new` timeout (seconds), keeping the time since the
    client's last connection. That time is read against the `old` rule timeout (the rule's
    `update` refreshes a pin to it, whatever timeout the element was first written with), and
    the result is capped at `new`; a pin already past `new` expires at once (1 ms: a delete
    would fail the transaction if the pin expired meanwhile). Written with `add`, which updates
    an existing element's timeout and expiry (Linux 6.10+; older kernels keep the old timer)."""
    elapsed = max(0.0, old - pin.expires)
    left = min(float(new), new - elapsed)
    return f"{pin.client} timeout {new}s expires {max(1, int(left * 1000))}ms"


# -- table state and transactions -------------------------------------------------------------------
@dataclass
class TableState:
    """What one family's table holds (as far as usproxy put it there)."""

    family: Family
    base: bool = False
    slots: dict[Kind, int] = field(default_factory=lambda: {"ip": 0, "np": 0})
    groups: set[str] = field(default_factory=set)
    hairpin: Counter[str] = field(default_factory=Counter)
    rules: dict[ServicePortName, PortRules] = field(default_factory=dict)
    orphans: dict[str, set[str]] = field(default_factory=dict)  # map/set -> keys to delete (read back)


class Transaction:
    """Commands for one atomic change of one family's table, in an order the kernel accepts:
    element deletes, chain flushes, chain and set deletes, then creations and element adds.
    `commit()` folds the change into the TableState only after the kernel accepted it."""

    def __init__(self, state: TableState) -> None:
        self.state = state
        self.deletes: list[Command] = []
        self.flushes: list[Command] = []
        self.drops: list[Command] = []
        self.creates: list[Command] = []
        self.adds: list[Command] = []
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
        dels = [Command("delete", "element", self.family, m, elems=tuple(e)) for m, e in self._elem_del.items() if e]
        adds = [Command("add", "element", self.family, m, elems=tuple(e)) for m, e in self._elem_add.items() if e]
        return [*dels, *self.deletes, *self.flushes, *self.drops, *self.creates, *self.adds, *adds]

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
                if be.affinity and any(affinity_endpoint(rules.spn, scope, t) == name for t in be.targets):
                    return be.affinity
        return None

    def _add_elem(self, m: str, e: Elem) -> None:
        self._elem_add[m].append(e)

    def _del_elem(self, m: str, key: str) -> None:
        self._elem_del[m].append(Elem(key))

    # -- shared structures
    def ensure_base(self, force: bool = False) -> None:
        """Write the table, maps and hooked chains, and rewrite the shared slot and group chains
        the table already has (after a read back: whatever was flushed behind our back)."""
        if force or not self._base:
            self.creates[:0] = base_commands(self.family) + self._shared_chains()
            self._base = True

    def _shared_chains(self) -> list[Command]:
        cmds = [c for kind in ("ip", "np") for i in range(self.state.slots[kind])
                for c in slot_commands(self.family, kind, i)]
        for name in sorted(self.state.groups, key=lambda n: "m" in n):  # plain g-N before gm-N
            m = GROUP_CHAIN.match(name)
            if m:
                kind: Kind = "ip" if m.group(1) == "g" else "np"
                cmds += chain_commands(self.family, name, group_rules(kind, int(m.group(3)), bool(m.group(2))))
        return cmds

    def _ensure_slots(self, kind: Kind, n: int) -> None:
        for i in range(self._slots[kind], n):
            self.creates += slot_commands(self.family, kind, i)
        self._slots[kind] = max(self._slots[kind], n)

    def _ensure_group(self, kind: Kind, n: int, masq: bool) -> str:
        """Create chain g-N (npg-N, with `m`: masquerade) and the slots it needs; its name."""
        name = group_chain(kind, n, masq)
        if name in self.state.groups or name in self._groups:
            return name
        if masq:
            self._ensure_group(kind, n, False)
        self._ensure_slots(kind, n)
        self._groups.add(name)
        self.creates += chain_commands(self.family, name, group_rules(kind, n, masq))
        return name

    # -- per ServicePort
    def update(self, prev: PortRules | None, new: PortRules | None) -> None:
        """Change the table from `prev` to `new` for one ServicePort (either may be None)."""
        if prev == new:
            return
        spn = (new or prev).spn  # type: ignore[union-attr]
        self.ensure_base()
        self._rules[spn] = new
        if (prev and _owns_chains(prev)) or (new and _owns_chains(new)):
            self._own_chains(prev, new)
        if prev is None and new is not None:
            self._add_frontends(new)
            self._add_hairpin(new)
        else:
            self._frontends(prev, new)
            self._hairpin_delta(prev, new)

    def _add_frontends(self, new: PortRules) -> None:
        """The common cold-start case (nothing installed before), without the diff."""
        adds = self._elem_add
        for fe in new.frontends:
            be = new.cluster if fe.scope == "cluster" else new.external
            kind: Kind = "ip" if fe.addr is not None else "np"
            key, n = fe.key(), len(be.targets)
            if n and not be.affinity:
                verdict = verdict_of(new, fe) if be.round_robin else self._ensure_group(kind, n, be.masq)
                for i, t in enumerate(be.targets):
                    adds[slot_map(kind, i)].append(_new(Elem, (key, t.nft(), None)))
            else:
                verdict = verdict_of(new, fe)
            adds[verdict_map(kind, not n)].append(_new(Elem, (key, "goto " + verdict, comment_of(new.spn, fe.scope))))

    def _add_hairpin(self, new: PortRules) -> None:
        """_hairpin_delta's cold-start case: every target is new for this ServicePort."""
        have, delta, adds = self.state.hairpin, self._hairpin, self._elem_add["hairpin"]
        for ip in new.hairpin:
            d = delta[ip] = delta.get(ip, 0) + 1
            if have.get(ip, 0) + d == 1:
                adds.append(_new(Elem, (f"{ip} . {ip}", None, None)))

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
        if p_verdict != n_verdict or (prev and new and prev.spn != new.spn):
            if prev is not None:
                self._del_elem(verdict_map(fe.kind, not p_be.targets), fe.key())  # type: ignore[union-attr]
            if new is not None:
                assert n_be is not None
                if n_be.targets and not n_be.affinity and not n_be.round_robin:
                    self._ensure_group(fe.kind, len(n_be.targets), n_be.masq)
                self._add_elem(verdict_map(fe.kind, not n_be.targets),
                               Elem(fe.key(), f"goto {n_verdict}", comment_of(new.spn, fe.scope)))
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
        old = own_chains(self.family, prev) if prev else {}
        cur = own_chains(self.family, new) if new else {}
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

    def commit(self) -> None:
        s = self.state
        s.orphans = {}
        s.base = self._base
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
    return bool(rules.cluster.affinity or rules.external.affinity or rules.cluster.round_robin or rules.external.round_robin)


def _has_affinity(rules: PortRules, scope: Scope) -> bool:
    be = rules.backend(scope)
    return bool(be.affinity and be.targets and any(fe.scope == scope for fe in rules.frontends))
