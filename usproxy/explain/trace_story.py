"""TraceStory: `explain trace` told as a story: first the answer, one line per mode, then the walk.

The answer line of a mode says, from its tracer's paths alone: where new connections land (which
endpoints of the ServicePort, with their shares; or refused, dropped, not a Service), whether they
are masqueraded, what source the backend sees, and how many rendered rules the first packet
walked (with lookups). Then each mode's walk, without repetition: the hops every path shares are
printed once, then where the paths part. The default form prints one path in full (the shortest:
the usual case) and one line for each other path; `detail` prints every path in full with what
follows its first packet (reply.lines). "No match" runs are folded into the line of the rule that
matched next, so the walk stays short; the rule texts are the views' own (trace.py).

Invariant: values in, text out; every phrase comes from the paths (their shares, `lands`,
`masquerade`, `seen`, `aside`, counts) or from the mode's record, never from the mode's name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from usproxy.explain import reply
from usproxy.explain.mode import NO_OPTIONS, Mode, TraceOptions
from usproxy.explain.packet import Packet, Path
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.model.types import format_hostport

OUTCOMES = {"", "REJECT", "DROP", "ERROR", "ACCEPT"}  # `lands` values that are no endpoint
_MISS = re.compile(r"^(?P<chain>.+) (?P<which>rules? \d+(?:-\d+)?): no match$")
_HIT = re.compile(r"^(?P<chain>.+) rule (?P<i>\d+): (?P<text>.*)$", re.S)
_REFUSED = re.compile(r"answers the first packet with (?P<answer>.+?), from ")


def render(ss: ServiceSet, pkt: Packet, modes: Sequence[Mode], opts: TraceOptions = NO_OPTIONS,
           detail: bool = False, about: str = "") -> str:
    """The whole trace: what is traced (`about`: a line on the source, from the caller), one
    answer line per mode, then each mode's walk (`detail`: every path in full)."""
    traced = [(mode, mode.trace(ss, pkt, opts)) for mode in modes]
    width = max(len(m.name) for m in modes)
    out = [f"# {pkt.src} -> {format_hostport(pkt.dst, pkt.dport)}/{pkt.proto}: {destination(ss, pkt)}"]
    if about:
        out.append(f"# {about}")
    out.append("")
    out += [f"{mode.name:<{width}}  {answer(mode, pkt, paths, ss)}" for mode, paths in traced]
    for mode, paths in traced:
        out += ["", f"## {mode.title}"]
        out += walk(mode, ss, pkt, paths, detail)
    out += ["", "# only a connection's first packet walks rules; later packets and replies ride what it left "
            "(conntrack, IPVS's table, the connected socket, the relay's two sockets)"
            + ("" if detail else "; --detail: every path in full, with what follows its first packet")]
    return "\n".join(out) + "\n"


# --- what is traced --------------------------------------------------------------------------

def service_port_of(ss: ServiceSet, pkt: Packet) -> tuple[FamilyPort, str] | None:
    """The ServicePort `pkt` is addressed to and how: its ClusterIP, an externalIP, a
    LoadBalancer IP, or its NodePort (at a node address); None for no Service."""
    for fp in ss.family_ports(pkt.dst.version):
        if fp.sp.protocol != pkt.proto:
            continue
        if pkt.dport == fp.sp.port:
            for kind, ips in (("ClusterIP", (fp.cluster_ip,)), ("externalIP", fp.external_ips),
                              ("LoadBalancer IP", fp.lb_ips)):
                if pkt.dst in ips:
                    return fp, kind
        if fp.sp.node_port == pkt.dport and pkt.dst_local:
            return fp, "NodePort"
    return None


def destination(ss: ServiceSet, pkt: Packet) -> str:
    """What DST:PORT is, in words."""
    found = service_port_of(ss, pkt)
    if found is None:
        return "no Service's frontend (as far as the input says)"
    fp, kind = found
    eps = len(fp.cluster)
    has = f"{eps} endpoint{'s' * (eps != 1)}" if eps else "no endpoint"
    return f"a new connection to {fp.name}, its {kind} ({has})"


# --- the answer line -------------------------------------------------------------------------

def answer(mode: Mode, pkt: Packet, paths: Sequence[Path], ss: ServiceSet) -> str:
    """One line: where it lands, masquerade, what the backend sees, the rules walked."""
    reached = [p for p in paths if p.lands not in OUTCOMES]
    parts = [_where(mode, ss, pkt, paths)]
    if reached:
        parts += [_masquerade(pkt, reached), "the backend sees " + _seen(pkt, reached)]
    parts += sorted({p.aside for p in paths if p.aside})
    parts.append(_walked(mode, paths))
    return "; ".join(parts)


def _share_text(share: Fraction) -> str:
    return str(share) if share.denominator <= 12 else f"{float(share):.1%}"


def _where(mode: Mode, ss: ServiceSet, pkt: Packet, paths: Sequence[Path]) -> str:
    """Where new connections land: the endpoints reached (of which set), then other outcomes."""
    shares: dict[str, Fraction] = {}
    for p in paths:
        key = p.lands if p.lands not in OUTCOMES else _outcome(mode, pkt, p)
        shares[key] = shares.get(key, Fraction(0)) + p.share
    eps = [k for k in shares if any(q.lands == k and q.lands not in OUTCOMES for q in paths)]
    out = [_endpoint_set(ss, pkt, eps, [shares[e] for e in eps])] if eps else []
    out += [k if shares[k] == 1 else f"{k} ({_share_text(shares[k])})" for k in shares if k not in eps]
    return " or ".join(out)


def _endpoint_set(ss: ServiceSet, pkt: Packet, eps: list[str], shares: list[Fraction]) -> str:
    """"to 1 of its 3 endpoints (1/3 each)", "to 10.0.0.1:80 (its only endpoint)", "to
    10.0.0.1:80 (of its 1 endpoint on this node)": the endpoints reached, named by the set of
    the ServicePort's endpoints they are."""
    found = service_port_of(ss, pkt)
    cluster = [str(e) for e in found[0].cluster] if found else []
    local = [str(e) for e in found[0].local] if found else []
    if local and set(eps) == set(local) and set(local) != set(cluster):
        n, of = len(local), "on this node"
    elif cluster and set(eps) <= set(cluster):
        n, of = len(cluster), ""
    else:
        n, of = len(eps), "listed"
    of = f"its {n} endpoint{'s' * (n != 1)}" + (f" {of}" if of else "")
    if len(eps) == 1:
        return f"to {eps[0]} ({'its only endpoint' if of == 'its 1 endpoint' else 'of ' + of})"
    picked = f"1 of {of}" if len(eps) == n else f"1 of {len(eps)} of {of}"
    if len(set(shares)) == 1:
        return f"to {picked} ({_share_text(shares[0])} each)"
    return f"to {picked} ({', '.join(f'{e} {_share_text(s)}' for e, s in zip(eps, shares))})"


def _outcome(mode: Mode, pkt: Packet, p: Path) -> str:
    """A path that reached no endpoint, in a phrase."""
    if p.lands == "REJECT":
        text = mode.refusal(pkt, p)
        if "connect() itself fails" in text:
            return "refused: connect() fails at once (ECONNREFUSED)"
        m = _REFUSED.search(text)
        return f"refused at once ({m['answer']})" if m else text
    if p.lands == "DROP":
        return "dropped: no answer, the client times out"
    if p.lands == "ACCEPT":
        return "delivered to a local listener (the health check server)"
    if p.lands == "ERROR":
        return p.result
    return "not a Service connection here: routed as addressed"


def _masquerade(pkt: Packet, reached: Sequence[Path]) -> str:
    total = sum((p.share for p in reached), Fraction(0))
    masq = [p for p in reached if p.masquerade]
    if not masq:
        # only the userspace paths are `seen` (proxied): usproxy's relay translates no packet, kube-proxy 1.0 REDIRECTed
        return ("no NAT in usproxy's relay (kube-proxy 1.0 REDIRECTed to its proxy)" if all(p.seen for p in reached)
                else "not masqueraded")
    if len(masq) == len(reached):
        return "masqueraded"
    share = _share_text(sum((p.share for p in masq), Fraction(0)) / total)
    if all(p.lands.rpartition(":")[0].strip("[]") == str(pkt.src) for p in masq):
        return f"masqueraded only when it lands on {pkt.src} itself (hairpin, {share})"
    return f"masqueraded to {', '.join(p.lands for p in masq)} ({share})"


def _seen(pkt: Packet, reached: Sequence[Path]) -> str:
    """Who the backend sees as the client, the most usual first."""
    seen: dict[str, Fraction] = {}
    for p in reached:
        who = p.seen or ("this node" if p.masquerade else str(pkt.src))
        seen[who] = seen.get(who, Fraction(0)) + p.share
    return " or ".join(sorted(seen, key=lambda w: -seen[w]))


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _walked(mode: Mode, paths: Sequence[Path]) -> str:
    rules = _span([p.rules for p in paths])
    lookups = _span([p.lookups for p in paths])
    out = f"{rules} {mode.rules_walked}"
    if lookups != "0":
        out += f", {lookups} lookup{'s' * (lookups != '1')}"
    return out


# --- the walk --------------------------------------------------------------------------------

def folded(hops: Sequence[str]) -> list[str]:
    """`hops` with each "no match" run folded into a neighbour: before the next rule of the same
    chain that matched ("rule 3 (rules 1-2: no match): ..."), else after the previous line."""
    out: list[str] = []
    pending: tuple[str, str] | None = None
    for hop in hops:
        miss, hit = _MISS.match(hop), _HIT.match(hop)
        if miss:
            if pending is not None:
                out.append(f"{pending[0]} {pending[1]}: no match")
            pending = (miss["chain"], miss["which"])
            continue
        if pending is not None and hit and hit["chain"] == pending[0]:
            hop = f"{hit['chain']} rule {hit['i']} ({pending[1]}: no match): {hit['text']}"
        elif pending is not None:
            tail = f"  (then {pending[0]} {pending[1]}: no match)"
            if out:
                out[-1] += tail
            else:
                out.append(tail.strip(" ()"))
        pending = None
        out.append(hop)
    if pending is not None:
        tail = f"  (then {pending[0]} {pending[1]}: no match)"
        if out:
            out[-1] += tail
        else:
            out.append(f"{pending[0]} {pending[1]}: no match")
    return out


def _common(lists: Sequence[Sequence[str]]) -> int:
    """Length of the prefix every list shares."""
    n = 0
    while all(len(x) > n for x in lists) and len({x[n] for x in lists}) == 1:
        n += 1
    return n


def _ending(p: Path) -> str:
    return f"=> {p.result}" + (", masqueraded" if p.masquerade and "masquerade" not in p.result else "")


_PLACE = re.compile(r"^([^:\s][^:]*? rule \d+(?: \(rules? [\d-]+: no match\))?): ")


def _place(hops: Sequence[str]) -> str:
    """Where a path parts from the others when that is a rule ("nat KUBE-SVC-X rule 2 (rule
    1: no match)"), "" when it is a note or a lookup."""
    m = _PLACE.match(hops[0]) if hops else None
    return m[1] if m else ""


def _likewise(p: Path, q: Path) -> bool:
    """`p` ends as `q` does but for the endpoint (the same words around it)."""
    return p.lands not in OUTCOMES and p.result.replace(p.lands, "\0") == q.result.replace(q.lands, "\0")


def walk(mode: Mode, ss: ServiceSet, pkt: Packet, paths: Sequence[Path], detail: bool) -> list[str]:
    """One mode's hops: the shared ones once, then each path (see the module docstring)."""
    hops = [list(p.hops) if detail else folded(p.hops) for p in paths]
    n = _common(hops)
    out = [f"  {h}" for h in hops[0][:n]]
    if len(paths) == 1:
        out.append(f"  {_ending(paths[0])}")
        return out + (_after(mode, ss, pkt, paths[0], "  ") if detail else [])
    rest = [h[n:] for h in hops]
    if detail:
        for i, (p, r) in enumerate(zip(paths, rest), start=1):
            out.append(f"  path {i}/{len(paths)}, {p.share} of new connections: {p.rules} rules "
                       f"({p.matched} matched, {p.skipped} no match), {p.lookups} lookups")
            out += [f"    {h}" for h in r] + [f"    {_ending(p)}"] + _after(mode, ss, pkt, p, "    ")
        return out
    return out + _parted(paths, rest)


def _parted(paths: Sequence[Path], rest: Sequence[Sequence[str]]) -> list[str]:
    """Where the paths part: the shortest in full (the usual case), each other on one line (its
    place and where it lands), those that part at no rule and end alike together on one line."""
    shown = min(range(len(paths)), key=lambda i: (len(rest[i]), i))
    p, r = paths[shown], rest[shown]
    tag = f"  [{p.share}]"
    out = [f"{tag} {h}" if i == 0 else f"{' ' * len(tag)} {h}" for i, h in enumerate(r)]
    out.append(f"{tag} {_ending(p)}" if not r else f"{' ' * len(tag)} {_ending(p)}")
    alike = []
    for i, (q, rq) in enumerate(zip(paths, rest)):
        if i == shown:
            continue
        masq = ", masqueraded" if q.masquerade else ""
        place = _place(rq)
        if place and place != _place(r) and q.lands not in OUTCOMES:
            out.append(f"  [{q.share}] {place} => {q.lands}{masq}")
        elif _likewise(q, p):
            alike.append(f"{q.lands} [{q.share}{masq}]")
        else:
            out.append(f"  [{q.share}] {_ending(q)}")
    if alike:
        out.append(f"  likewise => {', '.join(alike)}")
    return out


def _after(mode: Mode, ss: ServiceSet, pkt: Packet, p: Path, indent: str) -> list[str]:
    return [f"{indent}after the first packet:"] + [f"{indent}  {line}" for line in reply.lines(mode, ss, pkt, p)]
