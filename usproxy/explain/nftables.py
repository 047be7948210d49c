"""The `kube-proxy` nftables table kube-proxy's nftables mode builds for a ServiceSet.

Follows kube-proxy pkg/proxy/nftables/proxier.go (setupNFTables, syncProxyRules,
writeServiceToEndpointRules) as its current tests expect (proxier_test.go baseRules /
TestOverallNFTablesRules): base chains filter-prerouting-pre-dnat, filter-output-pre-dnat,
filter-forward, filter-input, filter-output, nat-*; dispatch through the service-ips and
service-nodeports verdict maps; per-ServicePort service-*/local-*/external-* chains with a
`numgen random mod N vmap`; endpoint-* chains that mark hairpin traffic and dnat; services without
endpoints land in no-endpoint-services / no-endpoint-nodeports (goto reject-chain, or drop when only
local endpoints are missing); ClientIP affinity with per-endpoint dynamic timeout sets;
loadBalancerSourceRanges as a firewall-ips element per LB IP going to a per-ServicePort
firewall-* chain that drops other sources before DNAT (filter-*-pre-dnat). Services with a
healthCheckNodePort get no rule here: kube-proxy's nftables mode opens none for it.

`Table` is the structured result; `dump` writes it as kube-proxy's transaction (knftables
`add ...` lines, what its tests compare), `listing` as `nft list table` prints it back (nft
normalizes a few expressions: mark arithmetic, numgen spacing, timeouts, priorities).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from usproxy.model.endpoint import Endpoint
from usproxy.model import chain_names as names
from usproxy.offload.iptables.rules import Match, Plan, plan
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.model.types import Family, format_hostport

TABLE = "kube-proxy"
REJECT_CHAIN = "reject-chain"
MARK_MASQ = "mark-for-masquerade"
BASE_CHAINS: tuple[tuple[str, str, str, int], ...] = (
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-forward", "filter", "forward", 0),
    ("filter-input", "filter", "input", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
    ("nat-prerouting", "nat", "prerouting", -100),
)
JUMPS: tuple[tuple[str, str, str], ...] = (  # (from, extra, to), in kube-proxy's order
    ("filter-prerouting-pre-dnat", "ct state new", "firewall-check"),
    ("filter-forward", "ct state new", "service-endpoints-check"),
    ("filter-forward", "ct state new", "cluster-ips-check"),
    ("filter-input", "ct state new", "nodeport-endpoints-check"),
    ("filter-input", "ct state new", "service-endpoints-check"),
    ("filter-output", "ct state new", "service-endpoints-check"),
    ("filter-output-pre-dnat", "ct state new", "firewall-check"),
    ("filter-output", "ct state new", "cluster-ips-check"),
    ("nat-output", "", "services"),
    ("nat-postrouting", "", "masquerading"),
    ("nat-prerouting", "", "services"),
)
REGULAR_CHAINS = ("cluster-ips-check", "firewall-check", MARK_MASQ, "masquerading",
                  "nodeport-endpoints-check", REJECT_CHAIN, "services", "service-endpoints-check")


@dataclass(frozen=True, slots=True)
class NftRule:
    """One rule: its text, and what `trace` needs (match, verdict, numgen targets, dnat)."""

    chain: str
    text: str
    comment: str | None = None
    match: Match = Match()
    verdict: str = ""  # "jump X", "goto X", "drop", "reject", "return", "dnat", "" (continue)
    numgen: tuple[str, ...] = ()
    affinity_set: str | None = None
    to: str | None = None
    lookup: str | None = None  # the set or map this rule looks up, e.g. "service-ips"


@dataclass(frozen=True, slots=True)
class Element:
    key: tuple[str, ...]
    value: str | None = None
    comment: str | None = None

    def text(self) -> str:
        out = " . ".join(self.key)
        if self.comment is not None:
            out += f' comment "{self.comment}"'
        return out if self.value is None else f"{out} : {self.value}"


@dataclass
class Container:
    """A set or a map: type, flags, comment, elements."""

    name: str
    kind: str  # "set" or "map"
    type: str
    comment: str | None = None
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    elements: list[Element] = field(default_factory=list)
    # The keys of `elements`, so adding one stays O(1) (`explain --scale` fills maps of 5,000
    # Services); Table.element is the one writer of both.
    keys: dict[tuple[str, ...], Element] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Chain:
    name: str
    base: tuple[str, str, int] | None = None  # (type, hook, priority)
    comment: str | None = None
    rules: list[NftRule] = field(default_factory=list)


@dataclass
class Table:
    """One family's `kube-proxy` table."""

    family: Family
    containers: dict[str, Container] = field(default_factory=dict)
    chains: dict[str, Chain] = field(default_factory=dict)

    @property
    def ipx(self) -> str:
        return "ip" if self.family == 4 else "ip6"

    @property
    def addr_type(self) -> str:
        return "ipv4_addr" if self.family == 4 else "ipv6_addr"

    def chain(self, name: str, **kw: object) -> Chain:
        if name not in self.chains:
            self.chains[name] = Chain(name, **kw)  # type: ignore[arg-type]
        return self.chains[name]

    def rule(self, chain: str, text: str, **kw: object) -> None:
        self.chain(chain).rules.append(NftRule(chain, text, **kw))  # type: ignore[arg-type]

    def element(self, container: str, *key: str, value: str | None = None,
                comment: str | None = None) -> None:
        # A set or map holds a key once (nft merges repeated adds, as knftables' fake does).
        c = self.containers[container]
        if tuple(key) not in c.keys:
            c.keys[tuple(key)] = Element(tuple(key), value, comment)
            c.elements.append(c.keys[tuple(key)])

    def lookup(self, container: str, key: tuple[str, ...]) -> Element | None:
        return self.containers[container].keys.get(key)


def build(ss: ServiceSet, family: Family) -> Table:
    """The table kube-proxy's `family` proxier holds after a full sync of `ss`."""
    t = Table(family)
    _setup(t, ss)
    for fp in ss.family_ports(family):
        _service_port(t, ss, fp)
    return t


def _setup(t: Table, ss: ServiceSet) -> None:
    ipx, addr = t.ipx, t.addr_type
    node_ips = ss.node.ips_of(t.family)
    no_localhost = "ip daddr != 127.0.0.0/8" if t.family == 4 else "ip6 daddr != ::1"
    sets = [("cluster-ips", "Active ClusterIPs")]
    if node_ips:
        sets.append(("nodeport-ips", "IPs that accept NodePort traffic"))
    for name, comment in sets:
        t.containers[name] = Container(name, "set", addr, comment)
    for name, typ, comment in (
        ("firewall-ips", f"{addr} . inet_proto . inet_service : verdict",
         "destinations that are subject to LoadBalancerSourceRanges"),
        ("no-endpoint-nodeports", "inet_proto . inet_service : verdict",
         "vmap to drop or reject packets to service nodeports with no endpoints"),
        ("no-endpoint-services", f"{addr} . inet_proto . inet_service : verdict",
         "vmap to drop or reject packets to services with no endpoints"),
        ("service-ips", f"{addr} . inet_proto . inet_service : verdict",
         "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ("service-nodeports", "inet_proto . inet_service : verdict", "NodePort traffic"),
    ):
        t.containers[name] = Container(name, "map", typ, comment)
    for name, typ, hook, prio in BASE_CHAINS:
        t.chain(name, base=(typ, hook, prio))
    for name in REGULAR_CHAINS:
        t.chain(name, comment="helper for @no-endpoint-services / @no-endpoint-nodeports"
                if name == REJECT_CHAIN else None)
    for src, extra, dst in JUMPS:
        t.rule(src, f"{extra} jump {dst}".strip(), verdict=f"jump {dst}")
    mark = ss.node.masquerade_mark
    t.rule("cluster-ips-check", f"{ipx} daddr @cluster-ips reject", verdict="reject",
           comment="Reject traffic to invalid ports of ClusterIPs", lookup="cluster-ips")
    cidrs = ss.node.service_cidrs_of(t.family)
    if cidrs:
        t.rule("cluster-ips-check", f"{ipx} daddr {{ {', '.join(map(str, cidrs))} }} drop",
               verdict="drop", comment="Drop traffic to unallocated ClusterIPs")
    vmap = f"{ipx} daddr . meta l4proto . th dport vmap"
    t.rule("firewall-check", f"{vmap} @firewall-ips", lookup="firewall-ips")
    t.rule(MARK_MASQ, f"mark set mark or {mark}")
    t.rule("masquerading", f"mark and {mark} == 0 return", verdict="return")
    t.rule("masquerading", f"mark set mark xor {mark}")
    t.rule("masquerading", "masquerade fully-random")
    dest = f"{ipx} daddr @nodeport-ips" if node_ips else no_localhost
    t.rule("nodeport-endpoints-check", f"{dest} meta l4proto . th dport vmap @no-endpoint-nodeports",
           lookup="no-endpoint-nodeports")
    t.rule(REJECT_CHAIN, "reject", verdict="reject")
    t.rule("services", f"{vmap} @service-ips", lookup="service-ips")
    dest = f"{ipx} daddr @nodeport-ips" if node_ips else f"fib daddr type local {no_localhost}"
    t.rule("services", f"{dest} meta l4proto . th dport vmap @service-nodeports",
           lookup="service-nodeports")
    t.rule("service-endpoints-check", f"{vmap} @no-endpoint-services", lookup="no-endpoint-services")
    for ip in node_ips:
        t.element("nodeport-ips", str(ip))


def _service_port(t: Table, ss: ServiceSet, fp: FamilyPort) -> None:
    p = plan(fp)
    base = names.nft_base(fp.name)
    service, local, external = f"service-{base}", f"local-{base}", f"external-{base}"
    internal_chain = local if fp.internal_policy_local else service
    _elements(t, fp, p, internal_chain, external)
    if p.uses_cluster_chain:
        _policy_chain(t, ss, fp, service, fp.cluster, masq=not fp.internal_policy_local)
    if p.uses_local_chain:
        _policy_chain(t, ss, fp, local, fp.local, masq=fp.internal_policy_local)
    if p.uses_ext_chain:
        _external_chain(t, ss, fp, external, service,
                        local if fp.external_policy_local else service, p.has_external)
    if fp.firewalled:
        sources = " , ".join(fp.firewall_sources(ss.node))
        t.chain(f"firewall-{base}")
        t.rule(f"firewall-{base}", f"{t.ipx} saddr != {{ {sources} }} drop", verdict="drop")
    for ep in fp.reachable:
        _endpoint_chain(t, fp, ep)


def _elements(t: Table, fp: FamilyPort, p: Plan, internal_chain: str, external: str) -> None:
    proto, port, spn = fp.proto, str(fp.sp.port), str(fp.name)
    verdict = {"REJECT": f"goto {REJECT_CHAIN}", "DROP": "drop"}
    t.element("cluster-ips", str(fp.cluster_ip))
    if p.has_internal:
        t.element("service-ips", str(fp.cluster_ip), proto, port, value=f"goto {internal_chain}")
    elif p.internal_filter:
        t.element("no-endpoint-services", str(fp.cluster_ip), proto, port,
                  value=verdict[p.internal_filter[0]], comment=spn)
    for ip in (*fp.external_ips, *fp.lb_ips):
        if fp.has_endpoints:
            t.element("service-ips", str(ip), proto, port, value=f"goto {external}")
        if fp.firewalled and ip in fp.lb_ips:  # with or without endpoints, unlike iptables
            t.element("firewall-ips", str(ip), proto, port,
                      value=f"goto firewall-{names.nft_base(fp.name)}")
        if p.external_filter:
            t.element("no-endpoint-services", str(ip), proto, port,
                      value=verdict[p.external_filter[0]], comment=spn)
    if fp.sp.node_port:
        np = str(fp.sp.node_port)
        if fp.has_endpoints:
            t.element("service-nodeports", proto, np, value=f"goto {external}")
        if p.external_filter:
            t.element("no-endpoint-nodeports", proto, np, value=verdict[p.external_filter[0]],
                      comment=spn)


def _policy_chain(t: Table, ss: ServiceSet, fp: FamilyPort, chain: str,
                  eps: tuple[Endpoint, ...], masq: bool) -> None:
    """service-*/local-*: masquerade off-cluster ClusterIP traffic, affinity, then numgen."""
    ipx, cidr = t.ipx, ss.node.cluster_cidr(t.family)
    t.chain(chain)
    if masq and cidr is not None:
        t.rule(chain, f"{ipx} daddr {fp.cluster_ip} {ipx} saddr != {cidr} jump {MARK_MASQ}",
               match=Match(src=cidr, src_negated=True), verdict=f"jump {MARK_MASQ}")
    targets = tuple(f"endpoint-{names.nft_endpoint_base(fp.name, ep)}" for ep in eps)
    if fp.sp.session_affinity == "ClientIP":
        for ep, target in zip(eps, targets):
            aff = f"affinity-{names.nft_endpoint_base(fp.name, ep)}"
            t.rule(chain, f"{ipx} saddr @{aff} goto {target}", verdict=f"goto {target}",
                   affinity_set=aff)
    vmap = " , ".join(f"{i} : goto {target}" for i, target in enumerate(targets))
    t.rule(chain, f"numgen random mod {len(eps)} vmap {{ {vmap} }}", numgen=targets)


def _external_chain(t: Table, ss: ServiceSet, fp: FamilyPort, chain: str, service: str,
                    policy_chain: str, has_external: bool) -> None:
    ipx, cidr = t.ipx, ss.node.cluster_cidr(t.family)
    t.chain(chain)
    if not fp.external_policy_local:
        t.rule(chain, f"jump {MARK_MASQ}", verdict=f"jump {MARK_MASQ}")
    else:
        if cidr is not None:
            t.rule(chain, f"{ipx} saddr {cidr} goto {service}", comment="short-circuit pod traffic",
                   match=Match(src=cidr), verdict=f"goto {service}")
        t.rule(chain, f"fib saddr type local jump {MARK_MASQ}", comment="masquerade local traffic",
               match=Match(src_local=True), verdict=f"jump {MARK_MASQ}")
        t.rule(chain, f"fib saddr type local goto {service}", comment="short-circuit local traffic",
               match=Match(src_local=True), verdict=f"goto {service}")
    if has_external:
        t.rule(chain, f"goto {policy_chain}", verdict=f"goto {policy_chain}")


def _endpoint_chain(t: Table, fp: FamilyPort, ep: Endpoint) -> None:
    base = names.nft_endpoint_base(fp.name, ep)
    chain, ipx = f"endpoint-{base}", t.ipx
    t.chain(chain)
    t.rule(chain, f"{ipx} saddr {ep.ip} jump {MARK_MASQ}",
           match=Match(src=ipaddress.ip_network(ep.ip)), verdict=f"jump {MARK_MASQ}")
    if fp.sp.session_affinity == "ClientIP":
        aff = f"affinity-{base}"
        t.containers[aff] = Container(aff, "set", t.addr_type, flags=("dynamic", "timeout"),
                                      timeout=fp.sp.affinity_timeout)
        t.rule(chain, f"update @{aff} {{ {ipx} saddr }}")
    dest = format_hostport(ep.ip, ep.port)
    t.rule(chain, f"meta l4proto {fp.proto} dnat to {dest}", verdict="dnat", to=dest)


# --- rendering -----------------------------------------------------------------------------

def _container_dump(prefix: str, c: Container) -> str:
    parts = [f"type {c.type}"]
    if c.flags:
        parts.append("flags " + ",".join(c.flags))
    if c.timeout is not None:
        parts.append(f"timeout {c.timeout}s")
    if c.comment:
        parts.append(f'comment "{c.comment}"')
    return f"add {c.kind} {prefix} {c.name} {{ {' ; '.join(parts)} ; }}"


def _chain_dump(prefix: str, c: Chain) -> str:
    if c.base:
        typ, hook, prio = c.base
        return f"add chain {prefix} {c.name} {{ type {typ} hook {hook} priority {prio} ; }}"
    if c.comment:
        return f'add chain {prefix} {c.name} {{ comment "{c.comment}" ; }}'
    return f"add chain {prefix} {c.name}"


def _rule_text(r: NftRule) -> str:
    return r.text + (f' comment "{r.comment}"' if r.comment else "")


def dump(t: Table) -> str:
    """kube-proxy's transaction as knftables writes it (`add table|set|map|chain|rule|element`)."""
    prefix = f"{t.ipx} {TABLE}"
    lines = [f'add table {prefix} {{ comment "rules for kube-proxy" ; }}']
    lines += [_container_dump(prefix, c) for c in t.containers.values()]
    lines += [_chain_dump(prefix, c) for c in t.chains.values()]
    lines += [f"add rule {prefix} {c.name} {_rule_text(r)}" for c in t.chains.values() for r in c.rules]
    lines += [f"add element {prefix} {c.name} {{ {e.text()} }}"
              for c in t.containers.values() for e in c.elements]
    return "\n".join(lines) + "\n"


_PRIORITY = {("filter", -110): "dstnat - 10", ("filter", 0): "filter",
             ("nat", -100): "dstnat", ("nat", 100): "srcnat"}


def _listed(text: str, mark: str) -> str:
    """A rule as `nft list` prints it back."""
    full = f"0x{int(mark, 16):08x}"
    return (text.replace(f"mark set mark or {mark}", f"meta mark set meta mark | {full}")
            .replace(f"mark set mark xor {mark}", f"meta mark set meta mark ^ {full}")
            .replace(f"mark and {mark} == 0 return", f"meta mark & {full} == 0x00000000 return")
            .replace(" , ", ", "))


def _duration(seconds: int) -> str:
    out, rest = "", seconds
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out or "0s"


def _container_listing(c: Container) -> list[str]:
    lines = [f"\t{c.kind} {c.name} {{", f"\t\ttype {c.type}"]
    if c.flags:
        lines.append("\t\tflags " + ",".join(c.flags))
    if c.timeout is not None:
        lines.append(f"\t\ttimeout {_duration(c.timeout)}")
    if c.comment:
        lines.append(f'\t\tcomment "{c.comment}"')
    if c.elements:
        joined = (",\n\t\t\t     ").join(e.text() for e in c.elements)
        lines.append(f"\t\telements = {{ {joined} }}")
    return lines + ["\t}"]


def _chain_listing(c: Chain, mark: str) -> list[str]:
    lines = [f"\tchain {c.name} {{"]
    if c.comment:
        lines.append(f'\t\tcomment "{c.comment}"')
    if c.base:
        typ, hook, prio = c.base
        lines.append(f"\t\ttype {typ} hook {hook} priority {_PRIORITY[(typ, prio)]}; policy accept;")
    lines += [f"\t\t{_listed(_rule_text(r), mark)}" for r in c.rules]
    return lines + ["\t}"]


def listed_rules(t: Table, mark: str = "0x4000") -> dict[tuple[str, int], str]:
    """Every rule as `listing` prints it, by (chain, rule number from 1): what a trace quotes,
    so a rule reads the same in `explain trace` as in the view."""
    return {(c.name, i): _listed(_rule_text(r), mark) for c in t.chains.values()
            for i, r in enumerate(c.rules, start=1)}


def listing(t: Table, mark: str = "0x4000") -> str:
    """`nft list table ip kube-proxy` (or ip6): sets and maps, then chains."""
    lines = [f"table {t.ipx} {TABLE} {{", '\tcomment "rules for kube-proxy"']
    for c in t.containers.values():
        lines += _container_listing(c)
    for ch in t.chains.values():
        lines += _chain_listing(ch, mark)
    return "\n".join(lines + ["}"]) + "\n"


def render(ss: ServiceSet, fmt: str = "list") -> str:
    """The nftables view: one table per IP family, as `nft list` prints it or as a dump."""
    parts = []
    for family in ss.families():
        t = build(ss, family)
        if fmt == "dump":
            parts.append(f"# kube-proxy (nftables mode) transaction, IPv{family}\n" + dump(t))
        else:
            parts.append(f"# nft list table {t.ipx} {TABLE}\n" + listing(t, ss.node.masquerade_mark))
    return "\n".join(parts) if parts else "# no Services with a ClusterIP\n"
