"""`usproxy explain trace SRC DST:PORT/PROTO`: the path one new connection takes in each mode.

The walkers evaluate the renderers' own structured rules (iptables.Rule, nftables.NftRule), so a
trace can only follow rules that are really printed. A random choice (iptables `-m statistic`,
nftables `numgen`, IPVS rr, BPF slot) splits the walk: every branch is followed and reported with its
exact share (fractions.Fraction). A new client has no affinity entry yet, so `-m recent --rcheck` and
`@affinity-*` lookups do not match. Counts: `rules` are rules evaluated for the first packet,
`lookups` are hash-map/set lookups (nftables maps, IPVS service table, BPF maps). Counting stops at
the verdict that decides where the connection lands (DNAT); filter checks after DNAT are not counted.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from fractions import Fraction

from usproxy.errors import ConfigError
from usproxy.explain import bpf, iptables, ipvs, nftables
from usproxy.explain.iptables import Match
from usproxy.explain.service_set import ServiceSet
from usproxy.explain.userspace import proxy_port
from usproxy.types import IPAddress, format_hostport

MAX_DEPTH = 32


@dataclass(frozen=True, slots=True)
class Packet:
    """The first packet of a new connection."""

    src: IPAddress
    dst: IPAddress
    dport: int
    proto: str  # "TCP", "UDP", "SCTP"
    src_local: bool = False
    dst_local: bool = False

    @property
    def p(self) -> str:
        return self.proto.lower()


@dataclass
class Path:
    """One way through the rules: its share of new connections, its hops and where it lands."""

    share: Fraction = Fraction(1)
    hops: list[str] = field(default_factory=list)
    rules: int = 0
    lookups: int = 0
    result: str = ""
    masquerade: bool = False
    stopped: bool = False  # nftables: a goto'd chain ended without a verdict; the base chain is done

    def fork(self, share: Fraction) -> Path:
        return Path(self.share * share, list(self.hops), self.rules, self.lookups, self.result,
                    self.masquerade, self.stopped)


def parse_packet(src: str, dst: str, ss: ServiceSet) -> Packet:
    """SRC and "DST:PORT/PROTO" (IPv6 as "[addr]:port/proto"). Raises ConfigError."""
    try:
        target, _, proto = dst.rpartition("/") if "/" in dst else (dst, "", "TCP")
        host, _, port = target.rpartition(":")
        d = ipaddress.ip_address(host.strip("[]"))
        s = ipaddress.ip_address(src)
        n = int(port)
    except ValueError:
        raise ConfigError("expected SRC DST:PORT/PROTO, e.g. 10.0.0.5 10.96.0.10:53/UDP",
                          obj="trace", field=f"{src} {dst}") from None
    if proto.upper() not in ("TCP", "UDP", "SCTP"):
        raise ConfigError(f"protocol must be TCP, UDP or SCTP, got {proto!r}", obj="trace", field=dst)
    if s.version != d.version:
        raise ConfigError("source and destination are of different IP families", obj="trace",
                          field=f"{src} {dst}")
    local = set(ss.node.ips)
    return Packet(s, d, n, proto.upper(), s in local, d in local or d.is_loopback)


def _matches(m: Match, pkt: Packet) -> bool:
    checks = (
        m.proto is None or m.proto == pkt.p,
        m.dport is None or m.dport == pkt.dport,
        m.src is None or ((pkt.src in m.src) != m.src_negated),
        m.dst is None or ((pkt.dst in m.dst) != m.dst_negated),
        m.src_local is None or m.src_local == pkt.src_local,
        m.dst_local is None or m.dst_local == pkt.dst_local,
        m.recent_check is None,  # a new client has no affinity entry yet
    )
    return all(checks)


# --- iptables ------------------------------------------------------------------------------

def _ipt_walk(rs: iptables.Ruleset, table: iptables.Table, chain: str, pkt: Packet, path: Path,
              depth: int = 0) -> list[Path]:
    """Walk one chain; returns the paths that end (DNAT/REJECT/DROP) or fall through (result "")."""
    live, done = [path], []
    for i, rule in enumerate(rs.in_chain(table, chain), start=1):
        nxt = []
        for p in live:
            p.rules += 1
            if not _matches(rule.match, pkt):
                nxt.append(p)
                continue
            share = Fraction(rule.match.probability).limit_denominator(10_000) \
                if rule.match.probability else Fraction(1)
            if share != 1:
                nxt.append(p.fork(1 - share))
            taken = p.fork(share) if share != 1 else p
            taken.hops.append(f"{table} {chain} rule {i}: {rule.text()}")
            ended, cont = _ipt_target(rs, table, rule, pkt, taken, depth)
            done += ended
            nxt += cont
        live = nxt
    return done + live


def _ipt_target(rs: iptables.Ruleset, table: iptables.Table, rule: iptables.Rule, pkt: Packet,
                p: Path, depth: int) -> tuple[list[Path], list[Path]]:
    t = rule.target
    if t == "DNAT":
        p.result = f"DNAT to {rule.to_destination}"
        return [p], []
    if t in ("REJECT", "DROP", "ACCEPT"):
        p.result = t
        return [p], []
    if t in ("MARK", "MASQUERADE", "RETURN", ""):
        return [], [p]
    if t == iptables.MARK_MASQ:
        p.masquerade = True
        p.rules += 1  # the MARK rule inside KUBE-MARK-MASQ
        return [], [p]
    if depth >= MAX_DEPTH:
        raise RuntimeError(f"rule loop at {t}")
    out = _ipt_walk(rs, table, t, pkt, p, depth + 1)
    return [q for q in out if q.result], [q for q in out if not q.result]


def trace_iptables(ss: ServiceSet, pkt: Packet) -> list[Path]:
    rs = iptables.build(ss, pkt.dst.version)
    paths = _ipt_walk(rs, "nat", iptables.SERVICES, pkt, Path())
    out = []
    for p in paths:
        if p.result:
            out.append(p)
            continue
        for chain in (iptables.SERVICES, iptables.EXTERNAL_SERVICES):  # filter, ctstate NEW
            for q in _ipt_walk(rs, "filter", chain, pkt, p):
                p = q
            if p.result:
                break
        p.result = p.result or "no Service rule matched: routed as addressed"
        out.append(p)
    return out


# --- nftables ------------------------------------------------------------------------------

def _nft_key(pkt: Packet, nodeport: bool) -> tuple[str, ...]:
    return (pkt.p, str(pkt.dport)) if nodeport else (str(pkt.dst), pkt.p, str(pkt.dport))


def _nft_walk(t: nftables.Table, chain: str, pkt: Packet, path: Path, depth: int = 0) -> list[Path]:
    live, done = [path], []
    for i, rule in enumerate(t.chains[chain].rules, start=1):
        nxt = []
        for p in live:
            if p.stopped:
                done.append(p)
                continue
            p.rules += 1
            ended, cont = _nft_rule(t, chain, i, rule, pkt, p, depth)
            done += ended
            nxt += cont
        live = nxt
    return done + live


def _nft_rule(t: nftables.Table, chain: str, i: int, rule: nftables.NftRule, pkt: Packet,
              p: Path, depth: int) -> tuple[list[Path], list[Path]]:
    if rule.affinity_set:
        p.lookups += 1
        return [], [p]
    if rule.lookup:
        return _nft_lookup(t, chain, i, rule, pkt, p, depth)
    if rule.numgen:
        share = Fraction(1, len(rule.numgen))
        out: list[Path] = []
        for target in rule.numgen:
            q = p.fork(share)
            q.hops.append(f"{chain} rule {i}: numgen -> goto {target}")
            out += _nft_walk(t, target, pkt, q, depth + 1)
        for q in out:
            q.stopped = not q.result
        return out, []
    if "ct state new" not in rule.text and not _matches(rule.match, pkt):
        return [], [p]
    return _nft_verdict(t, f"{chain} rule {i}: {rule.text}", rule.verdict, rule.to, pkt, p, depth)


def _nft_lookup(t: nftables.Table, chain: str, i: int, rule: nftables.NftRule, pkt: Packet,
                p: Path, depth: int) -> tuple[list[Path], list[Path]]:
    name = rule.lookup or ""
    p.lookups += 1
    if name in ("cluster-ips",):
        hit = any(e.key == (str(pkt.dst),) for e in t.containers[name].elements)
        if not hit:
            return [], [p]
        return _nft_verdict(t, f"{chain} rule {i}: {rule.text}", "reject", None, pkt, p, depth)
    nodeport = "nodeport" in name
    if nodeport and not pkt.dst_local:
        return [], [p]
    el = t.lookup(name, _nft_key(pkt, nodeport))
    if el is None or el.value is None:
        return [], [p]
    return _nft_verdict(t, f"{chain} rule {i}: @{name}[{el.text()}]", el.value, None, pkt, p, depth)


def _nft_verdict(t: nftables.Table, hop: str, verdict: str, to: str | None, pkt: Packet, p: Path,
                 depth: int) -> tuple[list[Path], list[Path]]:
    p.hops.append(hop)
    word, _, target = verdict.partition(" ")
    if word == "dnat":
        p.result = f"dnat to {to}"
        return [p], []
    if word in ("drop", "reject"):
        p.result = word.upper()
        return [p], []
    if word == "return" or not word:
        return [], [p]
    if target == nftables.MARK_MASQ:
        p.masquerade, p.rules = True, p.rules + 1
        return [], [p]
    if depth >= MAX_DEPTH:
        raise RuntimeError(f"rule loop at {target}")
    out = _nft_walk(t, target, pkt, p, depth + 1)
    if word == "goto":  # goto does not come back: a fall-through ends the base chain
        for q in out:
            q.stopped = not q.result
        return out, []
    return [q for q in out if q.result or q.stopped], [q for q in out if not (q.result or q.stopped)]


def trace_nftables(ss: ServiceSet, pkt: Packet) -> list[Path]:
    t = nftables.build(ss, pkt.dst.version)
    hook = "output" if pkt.src_local else "prerouting"
    after = "filter-output" if pkt.src_local else (
        "filter-input" if pkt.dst_local else "filter-forward")
    paths = [Path()]
    for base in (f"filter-{hook}-pre-dnat", f"nat-{hook}", after):
        nxt = []
        for p in paths:
            p.stopped = False
            nxt += [p] if p.result else _nft_walk(t, base, pkt, p)
        paths = nxt
        if base.startswith("nat") and all(p.result for p in paths):
            break
    for p in paths:
        p.result = p.result or "no Service element matched: routed as addressed"
    return paths


# --- ipvs, bpf, userspace ------------------------------------------------------------------

def _split(eps: list[str], p: Path, hop: str) -> list[Path]:
    out = []
    for ep in eps:
        q = p.fork(Fraction(1, len(eps)))
        q.hops.append(hop)
        q.result = f"to {ep}"
        out.append(q)
    return out


def trace_ipvs(ss: ServiceSet, pkt: Packet) -> list[Path]:
    p = Path(rules=2, lookups=2)  # KUBE-SERVICES: the localhost RETURN rule, then the ipset match
    for vs in ipvs.virtual_servers(ss, pkt.dst.version):
        if (vs.proto, vs.address, vs.port) == (pkt.proto, pkt.dst, pkt.dport):
            p.lookups += 1
            hop = f"IPVS service {vs.proto} {format_hostport(vs.address, vs.port)} rr"
            if not vs.reals:
                p.hops.append(hop)
                p.result = "no real servers: IPVS drops it (TCP: the client retries, then times out)"
                return [p]
            return _split([f"{ep} (Masq)" for ep in vs.reals], p, hop)
    p.lookups += 1
    p.result = "no IPVS virtual server: routed as addressed"
    return [p]


def trace_bpf(ss: ServiceSet, pkt: Packet) -> list[Path]:
    for fe in bpf.frontends(ss):
        if (fe.address, fe.port, fe.proto) == (pkt.dst, pkt.dport, pkt.proto) or (
                fe.type == "NodePort" and fe.address.is_unspecified and pkt.dst_local
                and (fe.port, fe.proto) == (pkt.dport, pkt.proto)):
            p = Path(lookups=1)
            p.hops.append(f"services map {fe.text()} (0): {len(fe.backends)} backends, revNAT {fe.id}")
            if not fe.backends:
                p.result = "no backends: connect() fails at once (ECONNREFUSED / ICMP unreachable)"
                return [p]
            p.lookups += 2  # the chosen slot, then the backends map
            return _split([f"{b} (rewritten at connect(), no per-packet NAT)" for b in fe.backends],
                          p, f"slot 1..{len(fe.backends)} chosen at random -> backends map")
    return [Path(lookups=1, result="no frontend: routed as addressed")]


def trace_userspace(ss: ServiceSet, pkt: Packet) -> list[Path]:
    for fp in ss.family_ports(pkt.dst.version):
        addrs = (fp.cluster_ip, *fp.external_ips, *fp.lb_ips)
        if fp.sp.protocol != pkt.proto or not (
                (pkt.dst in addrs and pkt.dport == fp.sp.port)
                or (pkt.dst_local and fp.sp.node_port == pkt.dport)):
            continue
        internal = pkt.dst == fp.cluster_ip
        p = Path(lookups=1)
        p.hops.append(f"kube-proxy 1.0: portal rule -> REDIRECT to 0.0.0.0:{proxy_port(fp)}")
        where = "a local address on usproxy0" if internal else "a local address of this node"
        eps = [str(e) for e in (fp.internal if internal else fp.external)]
        if not eps:
            p.hops.append(f"usproxy: {format_hostport(pkt.dst, pkt.dport)} is {where}, but the relay "
                          "does not listen while the ServicePort has no usable endpoint")
            p.result = "refused by the kernel: " + ("TCP RST" if pkt.proto == "TCP" else "ICMP port unreachable")
            return [p]
        p.hops.append(f"usproxy: {format_hostport(pkt.dst, pkt.dport)} is {where}: the kernel's "
                      "socket lookup finds the relay's listener")
        return _split([f"{ep} (a second connection, from the relay)" for ep in eps], p,
                      f"relay picks an endpoint ({fp.sp.lb_policy or 'roundRobin'})")
    if any(pkt.dst == fp.cluster_ip or pkt.dst in fp.external_ips for fp in ss.family_ports(pkt.dst.version)):
        closed = "TCP RST" if pkt.proto == "TCP" else "ICMP port unreachable"
        return [Path(lookups=1, result=f"a Service address, but no ServicePort on this port: refused by the kernel ({closed})")]
    return [Path(lookups=1, result="no listener: routed as addressed")]


TRACERS = {"userspace": trace_userspace, "iptables": trace_iptables, "ipvs": trace_ipvs,
           "nftables": trace_nftables, "bpf": trace_bpf}


def render(ss: ServiceSet, pkt: Packet, modes: tuple[str, ...]) -> str:
    head = f"{pkt.src} -> {format_hostport(pkt.dst, pkt.dport)}/{pkt.proto}"
    out = []
    for mode in modes:
        paths = TRACERS[mode](ss, pkt)
        out.append(f"## {mode}: {head}")
        for n, p in enumerate(paths, start=1):
            masq = ", masqueraded" if p.masquerade else ""
            out.append(f"  path {n}/{len(paths)}  share {p.share}  rules {p.rules}  "
                       f"lookups {p.lookups}{masq}")
            out += [f"    {hop}" for hop in p.hops]
            out.append(f"    => {p.result}")
        out.append("")
    return "\n".join(out)
