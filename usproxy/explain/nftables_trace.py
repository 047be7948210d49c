"""A tracer over kube-proxy's nftables transaction text: the nftables view's own dump, walked.

As kube-proxy's nftablesTracer (pkg/proxy/nftables/helpers_test.go): the `add rule` /
`add element` lines are read back, and each rule is consumed from the left by a fixed list of
patterns, one per expression kube-proxy writes; a match that fails ends the rule, a verdict ends
it. Text no pattern reads raises ValueError, so the view cannot print a rule the trace skips.

Differences from kube-proxy's tracer, for teaching: `numgen random` splits the path into
exact shares instead of collecting every endpoint; `jump mark-for-masquerade` is walked into (its
`mark set mark or` rule is what marks the packet) so the rule count includes it; `goto` ends the
calling chain when the target falls through, `jump` comes back; `ip saddr @affinity-*` never
matches (a new client has no affinity entry) but counts as a lookup.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from usproxy.explain.packet import Packet, Path

MAX_DEPTH = 32
_COMMENT = re.compile(r' comment "[^"]*"$')
_ELEMENT = re.compile(r"^add element \S+ \S+ (\S+) \{ (.*) \}$")
_RULE = re.compile(r"^add rule \S+ \S+ (\S+) (.*)$")
_CHAIN = re.compile(r"^add chain \S+ \S+ (\S+)")
_CONTAINER = re.compile(r"^add (?:set|map) \S+ \S+ (\S+) ")


@dataclass
class Dump:
    """Chains (rule texts, comments stripped) and set/map elements (key parts -> value) of a dump."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    elements: dict[str, dict[tuple[str, ...], str]] = field(default_factory=dict)


def parse_dump(text: str) -> Dump:
    """knftables `add ...` lines -> Dump."""
    d = Dump()
    for line in text.splitlines():
        if m := _CHAIN.match(line):
            d.chains.setdefault(m[1], [])
        elif m := _CONTAINER.match(line):
            d.elements.setdefault(m[1], {})
        elif m := _RULE.match(line):
            d.chains.setdefault(m[1], []).append(_COMMENT.sub("", m[2]))
        elif m := _ELEMENT.match(line):
            key, _, value = m[2].partition(" : ")
            key = re.sub(r' comment "[^"]*"', "", key)
            d.elements.setdefault(m[1], {})[tuple(key.split(" . "))] = value
    return d


Outcome = tuple[list[Path], list[Path]]  # (ended with a verdict, fell through / returned)


@dataclass(frozen=True, slots=True)
class Walker:
    """Walks one packet through a Dump (`fib ... type local` reads the packet's local flags).
    `wording`: how each rule is quoted in the hops, by (chain, rule number) (the view's
    `nft list` text, nftables.listed_rules); a rule not in it is quoted as the dump writes it."""

    dump: Dump
    pkt: Packet
    wording: Mapping[tuple[str, int], str] = field(default_factory=dict)

    def walk(self, chain: str, path: Path, depth: int = 0) -> Outcome:
        """Walk `chain`: (paths that ended with a verdict, paths that left it without one).
        A jump to a chain the dump never adds ends the path with lands "ERROR" (nft would refuse
        the transaction). Raises ValueError if `chain` itself is not declared or a rule is unread."""
        if chain not in self.dump.chains:
            raise ValueError(f"jump to a chain the dump does not declare: {chain}")
        if depth >= MAX_DEPTH:
            raise RuntimeError(f"rule loop at {chain}")
        live, ended, back = [path], [], []
        for i, rule in enumerate(self.dump.chains[chain], start=1):
            nxt: list[Path] = []
            for p in live:
                p.walked.append(rule)
                e, c, b = self.rule(chain, i, rule, p, depth)
                ended += e
                nxt += c
                back += b
            live = nxt
        return ended, back + live

    def rule(self, chain: str, i: int, full: str, p: Path,
             depth: int) -> tuple[list[Path], list[Path], list[Path]]:
        """(ended, continue in this chain, left this chain) after rule `i`, read from the left."""
        steps, rest = self._steps(), full
        while rest:
            for pattern, step in steps:
                m = pattern.match(rest)
                if m is None:
                    continue
                rest = rest[m.end():].lstrip()
                out = step(m, p)
                if out is False:
                    p.miss(chain, i)
                    return [], [p], []
                if isinstance(out, str):  # a verdict-map hit: its verdict replaces the rest
                    p.hit(f"{chain} rule {i}: {self.quoted(chain, i, full)}  [{out}]")
                    return self.verdict(out, p, depth)
                break
            else:
                if (m := re.match(r"^numgen random mod \d+ vmap \{ (.*) \}$", rest)) is not None:
                    return self.numgen(chain, i, full, m[1], p, depth)
                p.hit(f"{chain} rule {i}: {self.quoted(chain, i, full)}")
                return self.verdict(rest, p, depth)
        p.hit(f"{chain} rule {i}: {self.quoted(chain, i, full)}")
        return [], [p], []

    def quoted(self, chain: str, i: int, full: str) -> str:
        """Rule `i` of `chain` as the hops quote it (see `wording`)."""
        return self.wording.get((chain, i), full)

    def _steps(self) -> list[tuple[re.Pattern[str], Callable[[re.Match[str], Path], object]]]:
        return [(re.compile(pat), fn) for pat, fn in _steps_of(self)]

    def verdict(self, text: str, p: Path, depth: int) -> tuple[list[Path], list[Path], list[Path]]:
        word, _, target = text.partition(" ")
        if m := re.match(r"^meta l4proto (tcp|udp|sctp) dnat to (\S+)$", text):
            p.result, p.lands = f"dnat to {m[2]}", m[2]
            return [p], [], []
        if word in ("drop", "reject") and not target:
            p.result = p.lands = word.upper()
            return [p], [], []
        if text == "return":
            return [], [], [p]
        if word == "mark" and (m := re.match(r"^mark set mark (or|xor) \S+$", text)):
            p.masquerade = m[1] == "or"
            return [], [p], []
        if text in ("masquerade fully-random",) or text.startswith("update @"):
            return [], [p], []
        if word in ("jump", "goto") and target not in self.dump.chains:
            p.result = (f"{text}: a chain the transaction never adds, so nft would refuse the "
                        "whole transaction")
            p.lands = "ERROR"
            return [p], [], []
        if word in ("jump", "goto") and " " not in target:
            ended, back = self.walk(target, p, depth + 1)
            return (ended, back, []) if word == "jump" else (ended, [], back)
        raise ValueError(f"the tracer cannot read {text!r}")

    def numgen(self, chain: str, i: int, full: str, vmap: str, p: Path,
               depth: int) -> tuple[list[Path], list[Path], list[Path]]:
        targets = re.findall(r"\d+ : goto (\S+)", vmap)
        ended, back = [], []
        for target in targets:
            q = p.fork(Fraction(1, len(targets)))
            q.hit(f"{chain} rule {i}: {self.quoted(chain, i, full)}  [goto {target}]")
            e, _, b = self.verdict(f"goto {target}", q, depth)
            ended += e
            back += b
        return ended, [], back


def _addr_in(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, text: str) -> bool:
    return any(ip in ipaddress.ip_network(a.strip(), strict=False) for a in text.split(","))


def _steps_of(w: Walker) -> list[tuple[str, Callable[[re.Match[str], Path], object]]]:
    """(pattern, step): a step returns False (no match: the rule ends), True (go on reading the
    rule) or a verdict text (a verdict map hit). Order matters: lookups before literals."""
    pkt, els = w.pkt, w.dump.elements

    def lookup(name: str, key: tuple[str, ...], p: Path) -> str | None:
        p.lookups += 1
        return els[name].get(key)

    def dst_key() -> tuple[str, ...]:
        return (str(pkt.dst), pkt.p, str(pkt.dport))

    return [
        (r"^ct state new\b", lambda m, p: True),
        (r"^ip6? daddr \. meta l4proto \. th dport vmap @(\S+)$",
         lambda m, p: lookup(m[1], dst_key(), p) or False),
        (r"^meta l4proto \. th dport vmap @(\S+)$",
         lambda m, p: lookup(m[1], (pkt.p, str(pkt.dport)), p) or False),
        (r"^ip6? daddr @(\S+)", lambda m, p: lookup(m[1], (str(pkt.dst),), p) is not None),
        (r"^ip6? saddr @(\S+)", lambda m, p: lookup(m[1], ("new client",), p) is not None),
        (r"^ip6? daddr (!= )?\{ ([^}]*) \}", lambda m, p: _addr_in(pkt.dst, m[2]) != bool(m[1])),
        (r"^ip6? daddr (!= )?([0-9a-f.:/]+)", lambda m, p: _addr_in(pkt.dst, m[2]) != bool(m[1])),
        (r"^ip6? saddr (!= )?\{ ([^}]*) \}", lambda m, p: _addr_in(pkt.src, m[2]) != bool(m[1])),
        (r"^ip6? saddr (!= )?([0-9a-f.:/]+)", lambda m, p: _addr_in(pkt.src, m[2]) != bool(m[1])),
        (r"^fib daddr type local", lambda m, p: pkt.dst_local),
        (r"^fib saddr type local", lambda m, p: pkt.src_local),
        (r"^(tcp|udp|sctp) dport (\d+)", lambda m, p: (m[1], m[2]) == (pkt.p, str(pkt.dport))),
        (r"^mark and (\S+) == 0(?= )", lambda m, p: not p.masquerade),
    ]
