"""The iptables-restore input kube-proxy's iptables mode writes for a ServiceSet.

Follows kube-proxy pkg/proxy/iptables/proxier.go syncProxyRules and writeServiceToEndpointRules:
KUBE-SERVICES / KUBE-NODEPORTS dispatch, KUBE-SVC-* (Cluster policy), KUBE-SVL-* (Local policy),
KUBE-EXT-* (external destinations), KUBE-SEP-* (one per endpoint, DNAT), KUBE-MARK-MASQ,
KUBE-POSTROUTING, the filter table's REJECT/DROP rules for Services without (local) endpoints,
`-m statistic --mode random --probability 1/(n-i)` formatted "%0.10f", affinity via `-m recent`.

Each rule is a `Rule`: its exact text tokens plus a structured `Match` that `trace` and `cost`
evaluate, so the text shown and the path traced can never disagree. Output order is the canonical
order kube-proxy's own tests compare in (proxier_test.go sortIPTablesRules): tables by name;
KUBE-NODEPORTS, KUBE-SERVICES, then the other chains alphabetically; KUBE-SERVICES and
KUBE-NODEPORTS rules by Service name with the NodePort tail rule last. (kube-proxy itself writes
Services in Go map order.) loadBalancerSourceRanges: LB IP traffic goes through KUBE-FW-* (each
allowed source jumps on to KUBE-EXT-*), and what falls out of it without DNAT is dropped by the filter
table's KUBE-PROXY-FIREWALL; a healthCheckNodePort is accepted in the filter table's KUBE-NODEPORTS.

One generator, two uses: `usproxy explain --mode iptables` prints it, and the iptables datapath
(datapath.py) applies it. A Ruleset is the `skeleton` (no ServicePort's) with one `port_ruleset`
per ServicePort merged in (`assemble`), so the datapath regenerates only the ServicePorts that
changed; `build` assembles all of them, and both give the same text.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from usproxy.model.endpoint import Endpoint
from usproxy.model import chain_names as names
from usproxy.offload.iptables import jumps as iptables_entry
from usproxy.offload.iptables.jumps import Table
from usproxy.model.service_set import FamilyPort, Node, ServiceSet
from usproxy.model.types import Family, IPNetwork

MARK_MASQ = "KUBE-MARK-MASQ"
SERVICE_ADDRESS_SOURCE = "connection from the cluster IP itself"  # its comment (not kube-proxy's rule)
SERVICES = "KUBE-SERVICES"
NODEPORTS = "KUBE-NODEPORTS"
EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
POSTROUTING = "KUBE-POSTROUTING"
NODEPORTS_TAIL = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
SORTED_CHAINS = (SERVICES, NODEPORTS)  # their rules in Service name order (service_key), the rest as written
LARGE_CLUSTER_ENDPOINTS = 1000  # largeClusterEndpointsThreshold: above it, SEP comments go
LOCALHOST_NODEPORT_COUNTER = "localhost_nps_accepted_pkts"
INVALID_DROP_COUNTER = "ct_state_invalid_dropped_pkts"


@dataclass(frozen=True, slots=True)
class Match:
    """What a rule matches, for tracing. None means "not tested by this rule"."""

    proto: str | None = None
    src: IPNetwork | None = None
    src_negated: bool = False
    dst: IPNetwork | None = None
    dst_negated: bool = False
    dport: int | None = None
    src_local: bool | None = None
    dst_local: bool | None = None
    probability: str | None = None
    recent_check: str | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One `-A CHAIN ...` line: text tokens, structured match, target and DNAT destination."""

    table: Table
    chain: str
    tokens: tuple[str, ...]
    match: Match
    target: str
    to_destination: str | None = None
    comment: str | None = None

    def text(self) -> str:
        return " ".join(("-A", self.chain, *self.tokens))


@dataclass(frozen=True, slots=True)
class Options:
    """Host facts kube-proxy detects at start-up (defaults: a current Linux node)."""

    localhost_nodeports: bool = True  # --iptables-localhost-nodeports (IPv4 only)
    nfacct: bool = True  # the kernel has nfacct, so kube-proxy counts with it
    random_fully: bool = True  # iptables >= 1.6.2: MASQUERADE --random-fully
    conntrack_tcp_liberal: bool = False
    # Not kube-proxy's (the datapath sets it; explain prints kube-proxy's rules without it): a
    # node process's connection whose source is the ClusterIP it connects to is masqueraded.
    service_address_source: bool = False
    # Not kube-proxy's either: the conntrack mark table usproxy-return gives a load balancer's
    # hairpin (relay/return_route.py; 0: none), an LB IP as the source, which is a local
    # address here but not in kube-proxy: it is an outside client, not the node (_external).
    hairpin_mark: int = 0


class _Builder:
    """Accumulates one rule's tokens in kube-proxy's argument order, and its Match."""

    def __init__(self, table: Table, chain: str) -> None:
        self.table: Table = table
        self.chain = chain
        self.tokens: list[str] = []
        self.m: dict[str, object] = {}
        self.comment_text: str | None = None

    def comment(self, text: str | None) -> _Builder:
        if text is not None:
            self.comment_text = text
            self.tokens += ["-m", "comment", "--comment", f'"{text}"' if " " in text else text]
        return self

    def proto(self, proto: str) -> _Builder:
        self.tokens += ["-m", proto, "-p", proto]
        self.m["proto"] = proto
        return self

    def dst(self, net: str, negate: bool = False) -> _Builder:
        self.tokens += ["!", "-d", net] if negate else ["-d", net]
        self.m["dst"], self.m["dst_negated"] = ipaddress.ip_network(net, strict=False), negate
        return self

    def src(self, net: str, negate: bool = False) -> _Builder:
        self.tokens += ["!", "-s", net] if negate else ["-s", net]
        self.m["src"], self.m["src_negated"] = ipaddress.ip_network(net, strict=False), negate
        return self

    def dport(self, port: int) -> _Builder:
        self.tokens += ["--dport", str(port)]
        self.m["dport"] = port
        return self

    def addrtype(self, which: Literal["src", "dst"]) -> _Builder:
        self.tokens += ["-m", "addrtype", f"--{which}-type", "LOCAL"]
        self.m[f"{which}_local"] = True
        return self

    def raw(self, *tokens: str) -> _Builder:
        self.tokens += tokens
        return self

    def probability(self, text: str) -> _Builder:
        self.tokens += ["-m", "statistic", "--mode", "random", "--probability", text]
        self.m["probability"] = text
        return self

    def recent_check(self, name: str, seconds: int) -> _Builder:
        self.tokens += ["-m", "recent", "--name", name, "--rcheck", "--seconds", str(seconds), "--reap"]
        self.m["recent_check"] = name
        return self

    def jump(self, target: str, *extra: str, to: str | None = None) -> Rule:
        tokens = (*self.tokens, "-j", target, *extra) if target else tuple(self.tokens)
        return Rule(self.table, self.chain, tokens, Match(**self.m),  # type: ignore[arg-type]
                    target, to, self.comment_text)


def probability(n: int) -> str:
    """kube-proxy's computeProbability: 1/n as "%0.10f"."""
    return f"{1.0 / n:0.10f}"


@dataclass
class Ruleset:
    """The chains and rules of one family, in kube-proxy's emission order."""

    family: Family
    chains: dict[Table, list[str]] = field(default_factory=lambda: {"filter": [], "nat": []})
    rules: list[Rule] = field(default_factory=list)
    # Indexes of the two lists above, so declaring a chain and listing one chain's rules cost
    # O(1) and O(its rules) rather than O(all): `explain --scale` builds rulesets of 5,000 Services.
    _declared: set[tuple[Table, str]] = field(default_factory=set, repr=False, compare=False)
    _by_chain: dict[tuple[Table, str], list[Rule]] = field(default_factory=dict, repr=False, compare=False)

    def chain(self, table: Table, name: str) -> None:
        if (table, name) not in self._declared:
            self._declared.add((table, name))
            self.chains[table].append(name)

    def add(self, *rules: Rule) -> None:
        self.rules.extend(rules)
        for r in rules:
            self._by_chain.setdefault((r.table, r.chain), []).append(r)

    def in_chain(self, table: Table, chain: str) -> list[Rule]:
        return list(self._by_chain.get((table, chain), ()))


@dataclass(frozen=True, slots=True)
class Context:
    """One family's proxier settings every ServicePort's rules read (see `context`)."""

    family: Family
    node: Node
    opts: Options
    large: bool

    def if_local(self, b: _Builder, negate: bool = False) -> _Builder:
        """`b` with the detector's "from a pod" match (`negate`: "not from a pod"), as
        kube-proxy's IfLocal / IfNotLocal; unchanged when nothing is detected here."""
        match = self.node.local_match(self.family)
        if match is None:
            return b
        flag, value = match
        if flag == "-s":
            return b.src(value, negate=negate)
        return b.raw(*(("!",) if negate else ()), flag, value)




def context(node: Node, family: Family, opts: Options, total_endpoints: int) -> Context:
    """What every ServicePort's rules of one family depend on besides the ServicePort itself:
    the node, the options, and whether the endpoints of all ServicePorts together put the
    proxier in large-cluster mode (more than LARGE_CLUSTER_ENDPOINTS: KUBE-SEP comments go)."""
    return Context(family, node, opts, total_endpoints > LARGE_CLUSTER_ENDPOINTS)


def build(ss: ServiceSet, family: Family, opts: Options = Options()) -> Ruleset:
    """Every chain and rule kube-proxy's `family` proxier writes for `ss`: the skeleton and
    each ServicePort's own rules, in ServicePortName order (the order `ordered` keeps)."""
    fps = ss.family_ports(family)
    ctx = context(ss.node, family, opts, sum(len(fp.endpoints) for fp in fps))
    return assemble(ctx, [port_ruleset(ctx, fp) for fp in fps])


def port_ruleset(ctx: Context, fp: FamilyPort) -> Ruleset:
    """The chains and rules one ServicePort adds (its own chains and its rules in the shared
    ones): what a datapath regenerates when only that ServicePort changed."""
    rs = Ruleset(ctx.family)
    _service_port(rs, ctx, fp)
    return rs


def skeleton(ctx: Context) -> Ruleset:
    """The rules of no ServicePort: top-level chains, masquerade, the NodePort tail, forwarding."""
    rs = Ruleset(ctx.family)
    _top_level(rs, ctx)
    _nodeports_tail(rs, ctx)
    _forward(rs, ctx)
    return rs


def assemble(ctx: Context, ports: Sequence[Ruleset]) -> Ruleset:
    """The skeleton with the ServicePorts' rules (`ports`, in ServicePortName order) merged in."""
    rs = skeleton(ctx)
    for part in ports:
        for table in ("filter", "nat"):
            for chain in part.chains[table]:
                rs.chain(table, chain)
        rs.add(*part.rules)
    return rs


def _top_level(rs: Ruleset, ctx: Context) -> None:
    for chain in (SERVICES, EXTERNAL_SERVICES, "KUBE-FORWARD", NODEPORTS, PROXY_FIREWALL):
        rs.chain("filter", chain)
    for chain in (SERVICES, NODEPORTS, POSTROUTING, MARK_MASQ):
        rs.chain("nat", chain)
    mark = ctx.node.masquerade_mark
    masq = ("--random-fully",) if ctx.opts.random_fully else ()
    rs.add(
        _Builder("nat", POSTROUTING).raw("-m", "mark", "!", "--mark", f"{mark}/{mark}").jump("RETURN"),
        _Builder("nat", POSTROUTING).jump("MARK", "--xor-mark", mark),
        _Builder("nat", POSTROUTING).comment("kubernetes service traffic requiring SNAT")
        .jump("MASQUERADE", *masq),
        _Builder("nat", MARK_MASQ).jump("MARK", "--or-mark", mark),
    )
    if ctx.family == 4 and ctx.opts.localhost_nodeports:
        rs.chain("filter", "KUBE-FIREWALL")
        rs.add(_Builder("filter", "KUBE-FIREWALL").comment("block incoming localnet connections")
               .raw("-d", "127.0.0.0/8", "!", "-s", "127.0.0.0/8", "-m", "conntrack", "!",
                    "--ctstate", "RELATED,ESTABLISHED,DNAT").jump("DROP"))


@dataclass(frozen=True, slots=True)
class Plan:
    """The per-ServicePort decisions of syncProxyRules, before any rule is written."""

    internal_chain: str
    external_policy_chain: str
    has_internal: bool
    has_external: bool
    uses_cluster_chain: bool
    uses_local_chain: bool
    uses_ext_chain: bool
    uses_fw_chain: bool
    internal_filter: tuple[str, str] | None  # (target, comment) when internal traffic is refused
    external_filter: tuple[str, str] | None


def plan(fp: FamilyPort) -> Plan:
    """Which chains a ServicePort uses and what refuses its traffic (kube-proxy's variables)."""
    spn = fp.name
    local_ok = len(fp.local) > 0
    has_internal = fp.has_endpoints and (not fp.internal_policy_local or local_ok)
    has_external = fp.has_endpoints and (not fp.external_policy_local or local_ok)
    none = ("REJECT", f"{spn} has no endpoints")
    no_local = ("DROP", f"{spn} has no local endpoints")
    return Plan(
        internal_chain=names.svl_chain(spn) if fp.internal_policy_local else names.svc_chain(spn),
        external_policy_chain=names.svl_chain(spn) if fp.external_policy_local else names.svc_chain(spn),
        has_internal=has_internal, has_external=has_external,
        uses_cluster_chain=bool(fp.cluster) and fp.uses_cluster_endpoints,
        uses_local_chain=bool(fp.local) and fp.uses_local_endpoints,
        uses_ext_chain=fp.has_endpoints and fp.externally_accessible,
        uses_fw_chain=fp.has_endpoints and fp.firewalled,
        internal_filter=None if has_internal else (none if not fp.has_endpoints else no_local),
        external_filter=None if has_external else (none if not fp.has_endpoints else no_local),
    )


def _service_port(rs: Ruleset, ctx: Context, fp: FamilyPort) -> None:
    p = plan(fp)
    _capture(rs, ctx, fp, p)
    _internal(rs, ctx, fp, p)
    _external(rs, ctx, fp, p)
    if p.uses_fw_chain:
        _firewall(rs, ctx, fp)
    spn = fp.name
    if p.uses_cluster_chain:
        rs.chain("nat", names.svc_chain(spn))
        rs.add(*_to_endpoints(ctx, fp, names.svc_chain(spn), fp.cluster))
    if p.uses_local_chain:
        rs.chain("nat", names.svl_chain(spn))
        rs.add(*_to_endpoints(ctx, fp, names.svl_chain(spn), fp.local))
    for ep in fp.reachable:
        _endpoint(rs, ctx, fp, ep)


def _capture(rs: Ruleset, ctx: Context, fp: FamilyPort, p: Plan) -> None:
    """KUBE-SERVICES / KUBE-NODEPORTS entries, or the filter rules that refuse the traffic."""
    spn, port, ext = fp.name, fp.sp.port, names.ext_chain(fp.name)
    if p.has_internal:
        rs.add(_Builder("nat", SERVICES).comment(f"{spn} cluster IP").proto(fp.proto)
               .dst(str(fp.cluster_ip)).dport(port).jump(p.internal_chain))
    elif p.internal_filter:
        rs.add(_Builder("filter", SERVICES).comment(p.internal_filter[1]).proto(fp.proto)
               .dst(str(fp.cluster_ip)).dport(port).jump(p.internal_filter[0]))
    lb_chain = names.fw_chain(spn) if p.uses_fw_chain else ext
    for kind, ips, to in (("external IP", fp.external_ips, ext), ("loadbalancer IP", fp.lb_ips, lb_chain)):
        for ip in ips:
            if fp.has_endpoints:
                rs.add(_Builder("nat", SERVICES).comment(f"{spn} {kind}").proto(fp.proto)
                       .dst(str(ip)).dport(port).jump(to))
            if p.uses_fw_chain and kind == "loadbalancer IP":
                rs.add(_Builder("filter", PROXY_FIREWALL)
                       .comment(f"{spn} traffic not accepted by {names.fw_chain(spn)}")
                       .proto(fp.proto).dst(str(ip)).dport(port).jump("DROP"))
            if p.external_filter:
                rs.add(_Builder("filter", EXTERNAL_SERVICES).comment(p.external_filter[1])
                       .proto(fp.proto).dst(str(ip)).dport(port).jump(p.external_filter[0]))
    if fp.sp.node_port:
        _nodeport(rs, ctx, fp, p)
    if fp.sp.health_check_node_port:
        # Accepted whether or not this node has local endpoints (the health server answers 503).
        rs.add(_Builder("filter", NODEPORTS).comment(f"{spn} health check node port").proto("tcp")
               .dport(fp.sp.health_check_node_port).jump("ACCEPT"))


def _nodeport(rs: Ruleset, ctx: Context, fp: FamilyPort, p: Plan) -> None:
    spn, np, ext = fp.name, fp.sp.node_port, names.ext_chain(fp.name)
    if fp.has_endpoints:
        if ctx.opts.localhost_nodeports and ctx.family == 4 and ctx.opts.nfacct:
            rs.add(_Builder("nat", NODEPORTS).comment(str(spn)).proto(fp.proto)
                   .dst("127.0.0.0/8").dport(np)
                   .raw("-m", "nfacct", "--nfacct-name", LOCALHOST_NODEPORT_COUNTER).jump(ext))
        rs.add(_Builder("nat", NODEPORTS).comment(str(spn)).proto(fp.proto).dport(np).jump(ext))
    if p.external_filter:
        rs.add(_Builder("filter", EXTERNAL_SERVICES).comment(p.external_filter[1])
               .addrtype("dst").proto(fp.proto).dport(np).jump(p.external_filter[0]))


def _internal(rs: Ruleset, ctx: Context, fp: FamilyPort, p: Plan) -> None:
    """Masquerade all ClusterIP traffic (masqueradeAll), or what does not come from a pod (needs
    the local-traffic detector). Else, with Options.service_address_source, a connection from
    the ClusterIP itself: usproxy holds ClusterIPs as local addresses (on the ClusterIP
    interface), so the kernel gives a node process that connects to one without binding that
    address as its source, and an endpoint on another node, which holds the same address, would
    answer itself. kube-proxy's IPVS mode, whose kube-ipvs0 holds them the same way, masquerades
    these (KUBE-CLUSTER-IP src,dst); the nftables datapath does too."""
    if not p.has_internal:
        return
    if not (ctx.node.masquerade_all or ctx.node.local_match(ctx.family)):
        if ctx.opts.service_address_source:
            ip = str(fp.cluster_ip)
            rs.add(_Builder("nat", p.internal_chain).comment(f"{fp.name} {SERVICE_ADDRESS_SOURCE}")
                   .proto(fp.proto).src(ip).dst(ip).dport(fp.sp.port).jump(MARK_MASQ))
        return
    b = (_Builder("nat", p.internal_chain).comment(f"{fp.name} cluster IP").proto(fp.proto)
         .dst(str(fp.cluster_ip)).dport(fp.sp.port))
    rs.add((b if ctx.node.masquerade_all else ctx.if_local(b, negate=True)).jump(MARK_MASQ))


def _external(rs: Ruleset, ctx: Context, fp: FamilyPort, p: Plan) -> None:
    """KUBE-EXT-*: masquerade (Cluster policy) or the local short-circuits (Local policy)."""
    if not p.uses_ext_chain:
        return
    spn, ext, svc = fp.name, names.ext_chain(fp.name), names.svc_chain(fp.name)
    rs.chain("nat", ext)
    if not fp.external_policy_local:
        rs.add(_Builder("nat", ext).comment(f"masquerade traffic for {spn} external destinations")
               .jump(MARK_MASQ))
    else:
        if ctx.node.local_match(ctx.family):
            rs.add(ctx.if_local(_Builder("nat", ext).comment(f"pod traffic for {spn} external destinations"))
                   .jump(svc))
        if ctx.opts.hairpin_mark:
            mark = f"{ctx.opts.hairpin_mark:#x}"
            rs.add(_Builder("nat", ext).comment(f"LB hairpin for {spn} is an outside client")
                   .raw("-m", "connmark", "--mark", f"{mark}/{mark}")
                   .jump(p.external_policy_chain if p.has_external else "RETURN"))
        rs.add(_Builder("nat", ext).comment(f"masquerade LOCAL traffic for {spn} external destinations")
               .addrtype("src").jump(MARK_MASQ),
               _Builder("nat", ext).comment(f"route LOCAL traffic for {spn} external destinations")
               .addrtype("src").jump(svc))
    if p.has_external:
        rs.add(_Builder("nat", ext).jump(p.external_policy_chain))


def _firewall(rs: Ruleset, ctx: Context, fp: FamilyPort) -> None:
    """KUBE-FW-*: allowed sources go on to KUBE-EXT-*; the rest fall out of the chain without DNAT,
    and KUBE-PROXY-FIREWALL (filter) drops them. NodePorts never come here (as kube-proxy)."""
    spn, fw = fp.name, names.fw_chain(fp.name)
    rs.chain("nat", fw)
    for source in fp.firewall_sources(ctx.node):
        rs.add(_Builder("nat", fw).comment(f"{spn} loadbalancer IP").src(source)
               .jump(names.ext_chain(spn)))
    rs.add(_Builder("nat", fw).comment(f"other traffic to {spn} will be dropped by {PROXY_FIREWALL}")
           .jump(""))


def _to_endpoints(ctx: Context, fp: FamilyPort, chain: str, eps: Sequence[Endpoint]) -> list[Rule]:
    """Affinity checks, then the 1/(n-i) probability ladder (writeServiceToEndpointRules)."""
    out = []
    comment = (lambda ep: None) if ctx.large else (lambda ep: f"{fp.name} -> {ep}")
    if fp.sp.session_affinity == "ClientIP":
        for ep in eps:
            sep = names.sep_chain(fp.name, ep)
            out.append(_Builder("nat", chain).comment(comment(ep))
                       .recent_check(sep, fp.sp.affinity_timeout).jump(sep))
    n = len(eps)
    for i, ep in enumerate(eps):
        b = _Builder("nat", chain).comment(comment(ep))
        if i < n - 1:
            b.probability(probability(n - i))
        out.append(b.jump(names.sep_chain(fp.name, ep)))
    return out


def _endpoint(rs: Ruleset, ctx: Context, fp: FamilyPort, ep: Endpoint) -> None:
    sep = names.sep_chain(fp.name, ep)
    comment = None if ctx.large else str(fp.name)
    rs.chain("nat", sep)
    dnat = _Builder("nat", sep).comment(comment)
    if fp.sp.session_affinity == "ClientIP":
        dnat.raw("-m", "recent", "--name", sep, "--set")
    rs.add(_Builder("nat", sep).comment(comment).src(str(ep.ip)).jump(MARK_MASQ),
           dnat.proto(fp.proto).jump("DNAT", "--to-destination", str(ep), to=str(ep)))


def _nodeports_tail(rs: Ruleset, ctx: Context) -> None:
    """The last KUBE-SERVICES rule: local destinations go on to KUBE-NODEPORTS."""
    ips = ctx.node.nodeport_ips_of(ctx.family)
    if ips is None:
        b = _Builder("nat", SERVICES).comment(NODEPORTS_TAIL).addrtype("dst")
        if ctx.family == 6:
            b.dst("::1/128", negate=True)
        elif not ctx.opts.localhost_nodeports:
            b.dst("127.0.0.0/8", negate=True)
        rs.add(b.jump(NODEPORTS))
        return
    for ip in ips:
        rs.add(_Builder("nat", SERVICES).comment(NODEPORTS_TAIL).dst(str(ip)).jump(NODEPORTS))


def _forward(rs: Ruleset, ctx: Context) -> None:
    mark = ctx.node.masquerade_mark
    if not ctx.opts.conntrack_tcp_liberal:
        b = _Builder("filter", "KUBE-FORWARD").raw("-m", "conntrack", "--ctstate", "INVALID")
        if ctx.opts.nfacct:
            b.raw("-m", "nfacct", "--nfacct-name", INVALID_DROP_COUNTER)
        rs.add(b.jump("DROP"))
    rs.add(_Builder("filter", "KUBE-FORWARD").comment("kubernetes forwarding rules")
           .raw("-m", "mark", "--mark", f"{mark}/{mark}").jump("ACCEPT"),
           _Builder("filter", "KUBE-FORWARD").comment("kubernetes forwarding conntrack rule")
           .raw("-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED").jump("ACCEPT"))


def chain_order(chains: Sequence[str]) -> list[str]:
    """KUBE-NODEPORTS, KUBE-SERVICES, then the other chains by name."""
    first = [c for c in (NODEPORTS, SERVICES) if c in chains]
    return first + sorted(c for c in chains if c not in first)


def service_key(rule: Rule) -> tuple[int, str]:
    """orderByCommentServiceName, with the NodePort tail rule kept last."""
    text = rule.comment or ""
    if "must be the last rule" in text:
        return (1, "")
    cut = min((i for i in (text.find(" "), text.find(":")) if i >= 0), default=len(text))
    return (0, text[:cut])


def ordered(rs: Ruleset, table: Table) -> list[tuple[str, list[Rule]]]:
    """Chains of one table with their rules, in the canonical order."""
    out = []
    for chain in chain_order(rs.chains[table]):
        rules = rs.in_chain(table, chain)
        if chain in SORTED_CHAINS:
            rules = sorted(rules, key=service_key)
        out.append((chain, rules))
    return out


def render_ruleset(rs: Ruleset) -> str:
    """iptables-restore text: *filter then *nat, each with chain lines, rules and COMMIT."""
    lines: list[str] = []
    for table in ("filter", "nat"):
        chains = ordered(rs, table)
        lines.append(f"*{table}")
        lines += [f":{chain} - [0:0]" for chain, _ in chains]
        lines += [r.text() for _, rules in chains for r in rules]
        lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def render(ss: ServiceSet, opts: Options = Options()) -> str:
    """The whole iptables view: one iptables-restore input per IP family, each followed by the
    entry jumps from the built-in chains (usproxy/offload/iptables/jumps.py)."""
    parts = []
    for family in ss.families():
        tool = "iptables" if family == 4 else "ip6tables"
        rs = build(ss, family, opts)
        parts.append(f"# {tool}-restore input kube-proxy (iptables mode) writes, IPv{family}\n"
                     + render_ruleset(rs) + "\n" + iptables_entry.header(tool) + iptables_entry.render(rs.chains))
    return "\n".join(parts) if parts else "# no Services with a ClusterIP\n"
