"""nft commands: the fixed part of the table and the chains of the layout, as nft syntax.

Pure (no I/O). A `Command` renders as one line of nft's own syntax (`add element ip usproxy
slot-0 { ... }`); `render()` joins a transaction for libnftables (nftables/client.py), and the
same Commands drive FakeNft (nftables/fake.py) in unit tests. `base_commands()` writes the table,
its verdict maps and hooked chains, as kube-proxy's nftables mode (pkg/proxy/nftables/proxier.go
setupNFTables), after the agent's HookSettings (NodePort addresses, Service CIDRs); the other
builders write the shared slot and group chains and the chains of one ServicePort's own (ClientIP
affinity, lb-policy roundRobin, externalTrafficPolicy Local short-circuit, loadBalancerSourceRanges
firewall).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from usproxy.model.types import Family, Scope
from usproxy.offload.nftables.names import (
    MASQ_MARK,
    TABLE,
    Kind,
    addr_type,
    FIREWALL_MAP,
    affinity_chain,
    affinity_endpoint,
    firewall_chain,
    group_chain,
    nft_family,
    rr_chain,
    safe_comment,
    short_circuit_chain,
    short_circuit_pick,
    slot_chain,
    slot_map,
)
from usproxy.offload.nftables.rules import PortRules, local_verdict


class Elem(NamedTuple):
    """One set or map element in nft syntax (a NamedTuple for the same reason as Target)."""

    key: str
    value: str | None = None
    comment: str | None = None  # rendered through safe_comment: it cannot leave its quotes

    def nft(self) -> str:
        c = f' comment "{safe_comment(self.comment)}"' if self.comment is not None else ""
        return f"{self.key}{c}" if self.value is None else f"{self.key}{c} : {self.value}"


@dataclass(frozen=True, slots=True)
class Command:
    """One nft command in one family's table. `verb`: add/delete/flush; `obj`: table, map, set,
    chain, rule, element. `spec` is the type/hook text; `rule` the rule's nft text (all there is
    of a rule: the fake and the tests' tracer read this text, as the kernel does); `elems` for
    elements."""

    verb: str
    obj: str
    family: Family
    name: str = ""
    spec: str = ""
    rule: str = ""
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
                                  f'{k} comment "{safe_comment(c)}"' + ("" if v is None else f" : {v}") for k, v, c in self.elems])
            return f"{self.verb} element {where} {self.name} {{ {body} }}"
        if self.obj == "rule":
            return f"add rule {where} {self.name} {self.rule}"
        spec = f" {{ {self.spec} }}" if self.spec and self.verb == "add" else ""
        return f"{self.verb} {self.obj} {where} {self.name}{spec}"


def render(commands: Iterable[Command]) -> str:
    return "\n".join(c.nft() for c in commands) + "\n"


def operations(commands: Iterable[Command]) -> int:
    """The operations these commands make in the kernel's transaction: one per element added
    or deleted (one `add element` line may carry thousands), one per other command (a rule, a
    chain, map, set or table added or deleted, a chain flushed), as explain diff counts them."""
    return sum(len(c.elems) if c.obj == "element" else 1 for c in commands)


# the keys of `service-ips` as a plain set (Transaction.commands keeps them equal), for
# service_address_source's lookup
SERVICE_FRONTENDS = "service-frontends"
MARK_MASQ = f"meta mark set meta mark | {MASQ_MARK:#x}"  # masqueraded in nat-postrouting


# -- the fixed part ------------------------------------------------------------------------------------
def _ipx(family: Family) -> str:
    return nft_family(family)


def _not_localhost(family: Family) -> str:
    return "ip daddr != 127.0.0.0/8" if family == 4 else "ip6 daddr != ::1"


# A TCP packet that starts a conntrack entry without being a SYN belongs to a connection the
# kernel did not see open (tracking began after it, its entry expired or was deleted, and
# nf_conntrack_tcp_loose picked it up mid-stream): the relay owns it, so it is neither
# translated nor refused. Only connections the kernel saw open are DNATed or rejected.
ONLY_NEW_TCP = "meta l4proto tcp tcp flags & (fin | syn | rst | ack) != syn return"


@dataclass(frozen=True, slots=True)
class HookSettings:
    """What the hooked chains of one family's table depend on besides the family.

    `nodeport_ips`: NodePorts are served only on the addresses in set `nodeport-ips` (the
    datapath keeps its elements, NodeFacts.nodeport_ips); False: on every local address but
    loopback (`fib daddr type local`), as kube-proxy when nodePortAddresses match all.
    `service_cidrs`: this family's Service CIDRs (nft text); a new connection to an address in
    them that is not local is dropped (chain `cluster-ips-check`)."""

    nodeport_ips: bool = False
    service_cidrs: tuple[str, ...] = ()


NODEPORT_IPS = "nodeport-ips"


def base_commands(family: Family, hooks: HookSettings = HookSettings()) -> list[Command]:
    """Table, verdict maps, hairpin and nodeport-ips sets and the hooked chains; flushed and
    rewritten as a whole so a restart after an upgrade converges. Maps and sets are only added
    (idempotent), never emptied."""
    ipx, at = _ipx(family), addr_type(family)
    key3 = f"{ipx} daddr . meta l4proto . th dport"
    if hooks.nodeport_ips:  # kube-proxy: `ip daddr @nodeport-ips` when nodePortAddresses are given
        np_key = f"{ipx} daddr @{NODEPORT_IPS} meta l4proto . th dport"
    else:
        np_key = f"fib daddr type local {_not_localhost(family)} meta l4proto . th dport"
    cmds = [Command("add", "table", family)]
    for name in ("service-ips", "no-endpoint-services"):
        cmds.append(Command("add", "map", family, name, f"type {at} . inet_proto . inet_service : verdict;"))
    for name in ("service-nodeports", "no-endpoint-nodeports"):
        cmds.append(Command("add", "map", family, name, "type inet_proto . inet_service : verdict;"))
    cmds.append(Command("add", "set", family, SERVICE_FRONTENDS, f"type {at} . inet_proto . inet_service;"))
    cmds.append(Command("add", "set", family, "hairpin", f"type {at} . {at};"))
    cmds.append(Command("add", "set", family, NODEPORT_IPS, f"type {at};"))
    cmds.append(Command("add", "map", family, FIREWALL_MAP, f"type {at} . inet_proto . inet_service : verdict;"))
    chains: list[tuple[str, str, list[str]]] = [
        ("reject-chain", "", ["meta l4proto tcp reject with tcp reset", "reject"]),
        *firewall_base_chains(family),
        ("services", "", [ONLY_NEW_TCP, f"{key3} vmap @service-ips", f"{np_key} vmap @service-nodeports"]),
        ("endpoints-check", "", [ONLY_NEW_TCP, f"{key3} vmap @no-endpoint-services",
                                 f"{np_key} vmap @no-endpoint-nodeports"]),
        ("nat-prerouting", "type nat hook prerouting priority -100; policy accept;", ["jump services"]),
        ("nat-output", "type nat hook output priority -100; policy accept;", [
            *service_address_source(family), "jump services"]),
        ("nat-postrouting", "type nat hook postrouting priority 100; policy accept;", [
            f"meta mark & {MASQ_MARK:#x} == {MASQ_MARK:#x} meta mark set meta mark ^ {MASQ_MARK:#x} masquerade fully-random",
            f"ct status dnat {ipx} saddr . {ipx} daddr @hairpin masquerade fully-random"]),
        ("filter-input", "type filter hook input priority -110; policy accept;", ["ct state new jump endpoints-check"]),
        ("filter-forward", "type filter hook forward priority -110; policy accept;", [
            "ct state invalid drop", "ct state new jump endpoints-check"]),
        ("filter-output", "type filter hook output priority -110; policy accept;", ["ct state new jump endpoints-check"]),
    ]
    if hooks.service_cidrs:
        chains.insert(0, ("cluster-ips-check", "", cluster_ips_check(family, hooks.service_cidrs)))
        for name, _, rules in chains:
            if name in ("filter-forward", "filter-output"):
                rules.append("ct state new jump cluster-ips-check")
    for name, hook, rules in chains:
        cmds += chain_commands(family, name, rules, hook=hook)
    return cmds


def service_address_source(family: Family) -> list[str]:
    """Mark for masquerade a node process's connection whose source is the Service address it
    connects to, as kube-proxy's IPVS mode does for its kube-ipvs0 addresses (`-m set
    --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ` in its OUTPUT rules). ClusterIPs,
    externalIPs and LoadBalancer IPs are local addresses on the ClusterIP interface, so the kernel
    takes the address itself as the source of a connection to it (the local route's preferred
    source); DNATed, it would reach an endpoint on another node with that source, and the answer
    would go to that node, which holds the same address. Masqueraded, it leaves with the address
    the route to the endpoint picks, the node's, as in kube-proxy's other modes where Service
    addresses are not local. SERVICE_FRONTENDS holds exactly the keys of `service-ips`, the
    (address, protocol, port) frontends this table DNATs, so nothing else is touched. A set of its
    own, not a lookup in the verdict map: Linux 6.1 refuses a lookup in a map with EINVAL (found in
    the VM lab; later kernels accept it)."""
    return [f"{_ipx(family)} saddr . meta l4proto . th dport @{SERVICE_FRONTENDS} {MARK_MASQ}"]


def cluster_ips_check(family: Family, cidrs: Sequence[str]) -> list[str]:
    """Drop new connections to an unallocated address of the Service CIDRs instead of routing
    them on, as kube-proxy's nftables mode ("Drop traffic to unallocated ClusterIPs",
    pkg/proxy/nftables/proxier.go setupNFTables; DROP, not REJECT). kube-proxy tells allocated
    ClusterIPs by its `cluster-ips` set; here every allocated ClusterIP is a local address (the
    relay holds it on the ClusterIP interface, also for the ServicePorts only the relay serves,
    and the kernel refuses their undefined ports as kube-proxy's `cluster-ips` reject does), so
    what is local returns."""
    return ["fib daddr type local return", f"{_ipx(family)} daddr {{ {', '.join(cidrs)} }} drop"]


def firewall_base_chains(family: Family) -> list[tuple[str, str, list[str]]]:
    """loadBalancerSourceRanges, as kube-proxy's nftables mode: new connections are checked before
    DNAT (priority -110: they still carry the LB IP) in prerouting and output, against the
    `firewall-ips` verdict map, whose elements go to a ServicePort's firewall chain."""
    key3 = f"{_ipx(family)} daddr . meta l4proto . th dport"
    return [
        ("firewall-check", "", [f"{key3} vmap @{FIREWALL_MAP}"]),
        ("filter-prerouting-pre-dnat", "type filter hook prerouting priority -110; policy accept;",
         ["ct state new jump firewall-check"]),
        ("filter-output-pre-dnat", "type filter hook output priority -110; policy accept;",
         ["ct state new jump firewall-check"]),
    ]


def firewall_rules(family: Family, rules: PortRules) -> dict[str, list[str]]:
    """The ServicePort's firewall chain: drop a source outside the allowed ones (kube-proxy's
    `ip saddr != { ranges } drop`); none when nothing is filtered."""
    if not rules.fw_sources or not rules.fw_keys:
        return {}
    return {firewall_chain(rules.spn): [f"{_ipx(family)} saddr != {{ {', '.join(rules.fw_sources)} }} drop"]}


def chain_commands(family: Family, name: str, rules: Sequence[str], *, hook: str = "") -> list[Command]:
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
            *chain_commands(family, slot_chain(kind, i), [f"dnat {ipx} to {key} map @{m}"])]


def mark_rules(masq: bool, nonlocal_only: bool, not_local: str) -> list[str]:
    """The masquerade mark a chain sets first: none, always, or (`nonlocal_only`) only on
    traffic matching `not_local`, the table's local-traffic detector match (kube-proxy's
    `<IfNotLocalNFT> jump mark-for-masquerade` on ClusterIP traffic)."""
    if not masq:
        return []
    return [f"{not_local} {MARK_MASQ}" if nonlocal_only else MARK_MASQ]


def group_rules(kind: Kind, n: int, masq: bool, nonlocal_only: bool = False, not_local: str = "") -> list[str]:
    """Chain g-N (npg-N): pick one of the N slot chains at random; gm-N marks, then goes to g-N;
    gx-N marks what `not_local` matches (traffic not from a pod), then goes to g-N."""
    if masq:
        return [*mark_rules(True, nonlocal_only, not_local), f"goto {group_chain(kind, n, False)}"]
    return pick_rules([slot_chain(kind, i) for i in range(n)], False)


def pick_rules(chains: Sequence[str], round_robin: bool) -> list[str]:
    """Go to one of `chains`: `numgen random`, or `numgen inc` (a counter of this rule's own,
    so round robin per ServicePort) for lb-policy roundRobin."""
    if len(chains) == 1:
        return [f"goto {chains[0]}"]
    body = ", ".join(f"{i} : goto {c}" for i, c in enumerate(chains))
    mode = "inc" if round_robin else "random"
    return [f"numgen {mode} mod {len(chains)} vmap {{ {body} }}"]


def rr_rules(rules: PortRules, scope: Scope, not_local: str = "") -> dict[str, list[str]]:
    """lb-policy roundRobin without affinity: per frontend kind of `scope` a chain of this
    ServicePort's own that marks for masquerade when needed and picks a slot chain in turn."""
    be = rules.backend(scope)
    if not be.round_robin or be.affinity or not be.targets:
        return {}
    head = mark_rules(be.masq, be.nonlocal_only, not_local)
    kinds = sorted({fe.kind for fe in rules.frontends if fe.scope == scope})
    return {rr_chain(rules.spn, scope, k): head + pick_rules([slot_chain(k, i) for i in range(len(be.targets))], True)
            for k in kinds}


def own_chains(family: Family, rules: PortRules, not_local: str = "", if_local: str = "") -> dict[str, list[str]]:
    """The chains that belong to one ServicePort (affinity, round robin, short-circuit, firewall), by
    name. `not_local` / `if_local`: the table's local-traffic detector matches (mark_rules,
    short_circuit_rules)."""
    out: dict[str, list[str]] = firewall_rules(family, rules)
    for scope in ("cluster", "external"):
        if _has_affinity(rules, scope):
            out.update(affinity_rules(family, rules, scope, not_local))
        out.update(rr_rules(rules, scope, not_local))
    out.update(short_circuit_rules(family, rules, if_local))
    return out


def short_circuit_rules(family: Family, rules: PortRules, if_local: str) -> dict[str, list[str]]:
    """externalTrafficPolicy Local, as kube-proxy's external traffic chain: traffic from a pod
    (`if_local`, when the detector has a match for this family) goes to every endpoint unmarked,
    traffic from the node itself (`fib saddr type local`) is marked and goes to every endpoint,
    the rest goes to the local endpoints, or is dropped when there is none. One chain per
    frontend kind (their local verdicts differ) and one DNAT chain over every endpoint.
    IPv4: a local source that came in from the network (the chain is reached from prerouting;
    from output, `meta iiftype` matches nothing) is a load balancer's hairpin, its LB IP as the
    source (the only local source table usproxy-return lets in, relay/return_route.py): an
    outside client, as in kube-proxy, whose LB IPs are no local addresses."""
    be = rules.external
    if not be.short:
        return {}
    pick = short_circuit_pick(rules.spn)
    ipx, proto = _ipx(family), rules.spn.protocol.lower()
    body = ", ".join(f"{i} : {t.nft()}" for i, t in enumerate(be.short))
    # the DNAT chain first: chains are created in this order, and the others go to it
    out = {pick: [f"meta l4proto {proto} dnat {ipx} to numgen random mod {len(be.short)} map {{ {body} }}"]}
    for fe in rules.frontends:
        name = short_circuit_chain(rules.spn, fe.kind)
        if fe.scope != "external" or name in out:
            continue
        local = local_verdict(rules, fe)
        verdict = local if local == "drop" else f"goto {local}"
        out[name] = [*([f"{if_local} goto {pick}"] if if_local else []),
                     *([f"meta iiftype != loopback fib saddr type local {verdict}"] if family == 4 else []),
                     f"fib saddr type local {MARK_MASQ}", f"fib saddr type local goto {pick}", verdict]
    return out


def affinity_rules(family: Family, rules: PortRules, scope: Scope, not_local: str = "") -> dict[str, list[str]]:
    """kube-proxy's affinity: a set of client addresses per endpoint, checked before the random
    choice; the endpoint chain refreshes it (per-element timeout) and DNATs."""
    ipx = _ipx(family)
    be = rules.backend(scope)
    proto = rules.spn.protocol.lower()
    names = [affinity_endpoint(rules.spn, scope, t.hostport()) for t in be.targets]
    head = mark_rules(be.masq, be.nonlocal_only, not_local)
    checks = [f"{ipx} saddr @{n} goto {n}" for n in names]
    out = {affinity_chain(rules.spn, scope): head + checks + pick_rules(names, be.round_robin)}
    for n, t in zip(names, be.targets):
        addr = f"[{t.ip}]" if family == 6 else t.ip
        out[n] = [f"update @{n} {{ {ipx} saddr timeout {be.affinity}s }}",
                  f"meta l4proto {proto} dnat {ipx} to {addr}:{t.port}"]
    return out


def _has_affinity(rules: PortRules, scope: Scope) -> bool:
    be = rules.backend(scope)
    return bool(be.affinity and be.targets and any(fe.scope == scope for fe in rules.frontends))
