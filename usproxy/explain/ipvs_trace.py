"""A tracer over the IPVS view's text: nat helper rules, `ipset save`, kube-ipvs0 and `ipvsadm -Ln`.

kube-proxy's IPVS mode (pkg/proxy/ipvs/proxier.go) lets iptables decide masquerade only: the
first packet walks nat KUBE-SERVICES (ipset matches, `KUBE-MARK-MASQ`, `ACCEPT`), then IPVS, hooked
at LOCAL_IN, looks the destination up in its service table (an address bound to kube-ipvs0 is a
local address, so `--dst-type LOCAL` matches ClusterIPs too) and schedules a real server (rr: each
gets 1/n of new connections). The forwarding method "Masq" is IPVS's name for NAT of the
destination only: the source is not translated unless the packet carries the masquerade mark
(KUBE-POSTROUTING) or hairpins (KUBE-LOOP-BACK, matched after the destination is rewritten).
A virtual server without real servers makes ip_vs_leave() answer ICMP port unreachable, for TCP
as well (net/netfilter/ipvs/ip_vs_core.c), so it is counted as REJECT.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from usproxy.explain import ipvs
from usproxy.explain.iptables_trace import TextRule, Walker, parse_restore
from usproxy.explain.mode import NO_OPTIONS, TraceOptions
from usproxy.explain.packet import Packet, Path
from usproxy.model.service_set import ServiceSet
from usproxy.model.types import IPAddress, format_hostport


@dataclass(frozen=True, slots=True)
class VirtualService:
    line: str  # the `ipvsadm -Ln` line
    reals: tuple[str, ...]


def parse_ipvsadm(text: str) -> dict[tuple[str, str], VirtualService]:
    """`ipvsadm -Ln` -> {(PROTO, "addr:port"): VirtualService}."""
    out: dict[tuple[str, str], VirtualService] = {}
    key: tuple[str, str] | None = None
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("TCP", "UDP", "SCTP"):
            key = (words[0], words[1])
            out[key] = VirtualService(line, ())
        elif line.startswith("  -> ") and key is not None and words[1] != "RemoteAddress:Port":
            out[key] = replace(out[key], reals=(*out[key].reals, words[1]))
    return out


def parse_ipsets(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """`ipset save` -> {name: (type, members)}."""
    types: dict[str, str] = {}
    members: dict[str, set[str]] = {}
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["create"]:
            types[words[1]] = words[2]
            members[words[1]] = set()
        elif words[:1] == ["add"]:
            members[words[1]].add(words[2])
    return {name: (typ, frozenset(members[name])) for name, typ in types.items()}


def parse_ip_addr(text: str) -> set[IPAddress]:
    """`ip addr show kube-ipvs0` -> the bound addresses."""
    return {ipaddress.ip_interface(line.split()[1]).ip for line in text.splitlines()
            if line.strip().startswith(("inet ", "inet6 "))}


def trace_ipvs(ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]:
    fam = pkt.dst.version
    bound = parse_ip_addr(ipvs.ip_addr(ipvs.dummy_addresses(ss, fam)))
    pkt = replace(pkt, dst_local=pkt.dst_local or pkt.dst in bound)
    rules = parse_restore(ipvs.iptables_helpers(ss, fam))
    sets = parse_ipsets(ipvs.ipset_save(ss, fam))
    p = Walker(rules, pkt, sets).walk("nat", "KUBE-SERVICES", Path())[0]  # no probabilities
    p.result = ""
    if ("filter", ipvs.PROXY_FIREWALL) in rules:
        # filter INPUT (priority 0) runs before IPVS's LOCAL_IN hook: a blocked source never
        # reaches the service table.
        p = Walker(rules, pkt, sets).walk("filter", ipvs.PROXY_FIREWALL, p)[0]
        if p.lands == "DROP":
            return [p]
        p.result = ""
    services = parse_ipvsadm(ipvs.ipvsadm(ipvs.virtual_servers(ss, fam)))
    p.lookups += 1
    vs = services.get((pkt.proto, format_hostport(pkt.dst, pkt.dport)))
    if vs is None:
        return [_no_service(Walker(rules, pkt, sets), p, pkt.dst in bound)]
    p.note(f"IPVS service table: {vs.line}")
    if not vs.reals:
        p.result = ("no real servers: ip_vs_leave() answers ICMP port unreachable "
                    "(for TCP too), like a REJECT")
        p.lands = "REJECT"
        return [p]
    out = []
    for real in vs.reals:
        q = p.fork(Fraction(1, len(vs.reals)))
        q.note(f"  -> {real} Masq (rr: 1/{len(vs.reals)} of new connections)")
        q.result = (f"to {real} (forwarding method Masq: IPVS rewrites the destination only; "
                    "Masq is not source NAT)")
        q.lands = real
        _loop_back(rules, sets, pkt, real, q)
        out.append(q)
    return out


def _no_service(w: Walker, p: Path, bound: bool) -> Path:
    """No virtual server: an address on kube-ipvs0 meets filter INPUT's KUBE-IPVS-FILTER (which
    runs before IPVS's LOCAL_IN hook) and its REJECT of new connections; any other is routed."""
    pkt = w.pkt
    if not bound:
        p.result = "no IPVS virtual server: routed as addressed"
        return p
    why = f"{pkt.dst} is bound to {ipvs.DUMMY} but no IPVS service has this port: "
    if ("filter", ipvs.IPVS_FILTER) in w.rules:
        p = w.walk("filter", ipvs.IPVS_FILTER, p)[0]
        if p.lands == "REJECT":
            p.result = why + f"{ipvs.IPVS_FILTER} rejects a new connection (ICMP port unreachable)"
            return p
    p.result = why + f"the kernel refuses ({'TCP RST' if pkt.proto == 'TCP' else 'ICMP port unreachable'})"
    p.lands = "REJECT"
    return p


def _loop_back(rules: Mapping[tuple[str, str], list[TextRule]],
               sets: Mapping[str, tuple[str, frozenset[str]]], pkt: Packet, real: str, q: Path) -> None:
    """KUBE-POSTROUTING's KUBE-LOOP-BACK rule sees the rewritten destination: hairpin masquerade."""
    host, _, port = real.rpartition(":")
    after = replace(pkt, dst=ipaddress.ip_address(host.strip("[]")), dport=int(port))
    w = Walker(rules, after, sets)
    for i, rule in enumerate(rules.get(("nat", "KUBE-POSTROUTING"), []), start=1):
        if rule.target == "MASQUERADE" and any(c.kind == "match-set" for c in rule.conds):
            q.walked.append(rule.line)
            if w.share(rule, q) == 0:
                q.miss("nat KUBE-POSTROUTING (after IPVS)", i)
                continue
            q.hit(f"nat KUBE-POSTROUTING (after IPVS) rule {i}: {rule.line}")
            q.masquerade = True
