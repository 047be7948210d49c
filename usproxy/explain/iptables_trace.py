"""A tracer over iptables-restore text: the iptables view's own output, walked rule by rule.

As kube-proxy's tests trace their own dumps (pkg/util/iptables/testing/parse.go and the
iptablesTracer of pkg/proxy/iptables/proxier_test.go): every `-A CHAIN ...` line is split into its
matches and its target, and a packet is walked from a chain. Text the tracer cannot read raises
ValueError, so no rule can be rendered that the trace silently skips. Shared with the IPVS tracer,
whose helper rules match ipsets (`-m set --match-set`).

What it models for the first packet of a new connection: `-m statistic --probability` splits the
path with the exact share (every branch is followed); `-m recent --rcheck` never matches (a new
client has no affinity entry); `-m conntrack --ctstate` sees NEW (and DNAT once the nat table has
translated); `-m mark` tests the masquerade mark; `-j KUBE-MARK-MASQ` is walked into, and the
`MARK --or-mark` rule there is what marks the packet; `RETURN` goes back to the calling chain.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from usproxy.explain.packet import Packet, Path

MAX_DEPTH = 32
_SKIP_ONE = {"--comment", "--mode", "--name", "--seconds", "--nfacct-name"}
_FLAGS = {"--reap", "--set"}
_MODULES = {"tcp", "udp", "sctp", "comment", "addrtype", "statistic", "recent", "nfacct", "mark",
            "conntrack", "set", "physdev", "socket", "ipvs"}
_WITH_VALUE = {"-p": "proto", "-s": "src", "-d": "dst", "--dport": "dport", "--src-type": "src-type",
               "--dst-type": "dst-type", "--probability": "probability", "--mark": "mark",
               "--ctstate": "ctstate", "--vaddr": "vaddr", "--vproto": "vproto", "--vport": "vport"}


@dataclass(frozen=True, slots=True)
class Cond:
    """One match of a rule: kind ("dst", "dport", "match-set", ...), negated, value."""

    kind: str
    negated: bool
    value: str


@dataclass(frozen=True, slots=True)
class TextRule:
    """One `-A` line: its text, its matches, its target and the target's arguments."""

    table: str
    chain: str
    line: str
    conds: tuple[Cond, ...]
    target: str
    args: tuple[str, ...]

    def arg(self, name: str) -> str | None:
        return self.args[self.args.index(name) + 1] if name in self.args[:-1] else None


def parse_rule(table: str, line: str) -> TextRule:
    """`-A CHAIN ...` -> TextRule. Raises ValueError on a token the tracer does not read."""
    # Most rules hold no quoting (comments are quoted): str.split then gives shlex's tokens,
    # ten times faster, which `explain --scale` needs at thousands of Services.
    tokens = shlex.split(line) if any(c in line for c in "\"'\\") else line.split()
    if tokens[:1] != ["-A"] or len(tokens) < 2:
        raise ValueError(f"not a rule: {line}")
    conds: list[Cond] = []
    i, negate = 2, False
    while i < len(tokens):
        tok = tokens[i]
        if tok == "-j":
            return TextRule(table, tokens[1], line, tuple(conds), tokens[i + 1], tuple(tokens[i + 2:]))
        if tok == "!":
            negate, i = True, i + 1
            continue
        if tok == "-m" and tokens[i + 1] in _MODULES:
            i += 2
        elif tok in _SKIP_ONE:
            i += 2
        elif tok in _FLAGS:
            i += 1
        elif tok == "--rcheck":
            conds.append(Cond("rcheck", negate, ""))
            i += 1
        elif tok in ("--physdev-is-in", "--nowildcard"):  # --nowildcard: IPVS mode's KUBE-IPVS-FILTER
            conds.append(Cond(tok[2:], negate, ""))
            i += 1
        elif tok == "--match-set":
            conds.append(Cond("match-set", negate, f"{tokens[i + 1]} {tokens[i + 2]}"))
            i += 3
        elif tok in _WITH_VALUE:
            conds.append(Cond(_WITH_VALUE[tok], negate, tokens[i + 1]))
            i += 2
        else:
            raise ValueError(f"the tracer cannot read {tok!r} in: {line}")
        negate = False
    return TextRule(table, tokens[1], line, tuple(conds), "", ())


def parse_restore(text: str) -> dict[tuple[str, str], list[TextRule]]:
    """iptables-restore input -> rules per (table, chain), in order. Raises ValueError."""
    out: dict[tuple[str, str], list[TextRule]] = {}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":"):
            out.setdefault((table, line[1:].split()[0]), [])
        elif line.startswith("-A "):
            rule = parse_rule(table, line)
            out.setdefault((table, rule.chain), []).append(rule)
    return out


@dataclass(frozen=True, slots=True)
class Walker:
    """Walks a packet through parsed rules; `ipsets` are the members `ipset save` lists."""

    rules: Mapping[tuple[str, str], list[TextRule]]
    pkt: Packet
    ipsets: Mapping[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    def walk(self, table: str, chain: str, path: Path, depth: int = 0) -> list[Path]:
        """Paths that ended (result set), returned (RETURN) or fell off the end of `chain`.

        A jump to a chain the input never declares ends the path with lands "ERROR"
        (iptables-restore would refuse the input). Raises ValueError if `chain` itself is not
        declared."""
        if (table, chain) not in self.rules:
            raise ValueError(f"jump to a chain the rules do not declare: {table} {chain}")
        live, done = [path], []
        for i, rule in enumerate(self.rules[(table, chain)], start=1):
            nxt: list[Path] = []
            for p in live:
                p.walked.append(rule.line)
                share = self.share(rule, p)
                if share == 0:
                    p.miss(f"{table} {chain}", i)
                    nxt.append(p)
                    continue
                if share != 1:
                    rest = p.fork(1 - share)
                    rest.miss(f"{table} {chain}", i)
                    nxt.append(rest)
                taken = p.fork(share) if share != 1 else p
                taken.hit(f"{table} {chain} rule {i}: {rule.line}")
                ended, cont, returned = self.target(rule, taken, depth)
                done += ended + returned
                nxt += cont
            live = nxt
        return done + live

    def share(self, rule: TextRule, p: Path) -> Fraction:
        """The share of packets on `p` that `rule` matches (0 or 1 except for statistic)."""
        share = Fraction(1)
        for c in rule.conds:
            if c.kind == "probability":
                share *= Fraction(c.value).limit_denominator(10_000)
            elif self.test(c, p) == c.negated:
                return Fraction(0)
        return share

    def test(self, c: Cond, p: Path) -> bool:
        pkt = self.pkt
        if c.kind in ("src", "dst"):
            return (pkt.src if c.kind == "src" else pkt.dst) in ipaddress.ip_network(c.value, strict=False)
        if c.kind in ("src-type", "dst-type"):
            return c.value == "LOCAL" and (pkt.src_local if c.kind == "src-type" else pkt.dst_local)
        simple: dict[str, Callable[[], bool]] = {"proto": lambda: pkt.p == c.value, "dport": lambda: str(pkt.dport) == c.value,
                  "rcheck": lambda: False, "physdev-is-in": lambda: False,
                  "nowildcard": lambda: False,  # a socket bound to the address itself: none in a static input
                  "mark": lambda: p.masquerade,
                  "ctstate": lambda: bool({"NEW", *(["DNAT"] if p.lands else [])}
                                          & set(c.value.split(","))),
                  "match-set": lambda: self.in_set(c.value, p)}
        return simple[c.kind]()

    def in_set(self, spec: str, p: Path) -> bool:
        """`--match-set NAME DIRS` against `ipset save`'s members (hash:ip[,port[,ip|,net]],
        bitmap:port).

        One ipset lookup is counted on `p`; a set `ipset save` does not list is empty."""
        name, dirs = spec.split()
        p.lookups += 1
        if name not in self.ipsets:
            return False
        typ, members = self.ipsets[name]
        pkt = self.pkt
        addr = {"src": str(pkt.src), "dst": str(pkt.dst)}
        port = {"dst": f"{pkt.p}:{pkt.dport}", "src": ""}
        d = dirs.split(",")
        if typ == "hash:ip,port,net":  # members hold a CIDR: a match is containment, not equality
            head = f"{addr[d[0]]},{port[d[1]]},"
            ip = pkt.src if d[2] == "src" else pkt.dst
            return any(m.startswith(head) and ip in ipaddress.ip_network(m[len(head):], strict=False)
                       for m in members)
        shapes = {"hash:ip": lambda: addr[d[0]], "bitmap:port": lambda: str(pkt.dport),
                  "hash:ip,port": lambda: f"{addr[d[0]]},{port[d[1]]}",
                  "hash:ip,port,ip": lambda: f"{addr[d[0]]},{port[d[1]]},{addr[d[2]]}"}
        return shapes[typ]() in members

    def target(self, rule: TextRule, p: Path, depth: int) -> tuple[list[Path], list[Path], list[Path]]:
        """(ended, continue in this chain, returned to the caller) after `rule` matched."""
        t = rule.target
        if t == "DNAT":
            to = rule.arg("--to-destination") or ""
            p.result, p.lands = f"DNAT to {to}", to
            return [p], [], []
        if t in ("REJECT", "DROP", "ACCEPT"):
            p.result, p.lands = t, t if t != "ACCEPT" else p.lands
            return [p], [], []
        if t == "RETURN":
            return [], [], [p]
        if t == "MARK":
            if rule.arg("--or-mark"):
                p.masquerade = True
            elif rule.arg("--xor-mark"):
                p.masquerade = False
            return [], [p], []
        if t == "REDIRECT":
            p.result = f"REDIRECT to port {rule.arg('--to-ports')}"
            return [p], [], []
        if t in ("MASQUERADE", ""):
            return [], [p], []
        if (rule.table, t) not in self.rules:
            p.result = (f"-j {t}: a chain this input never declares, so iptables-restore would "
                        "refuse the whole input")
            p.lands = "ERROR"
            return [p], [], []
        if depth >= MAX_DEPTH:
            raise RuntimeError(f"rule loop at {t}")
        out = self.walk(rule.table, t, p, depth + 1)
        return [q for q in out if q.result], [q for q in out if not q.result], []
