"""A packet tracer over FakeNft that reads the rule text the kernel receives, nothing else.

As kube-proxy's nftables tests (pkg/proxy/nftables/helpers_test.go, runPacketFlowTests): every
rule is parsed from its nft text into matches and statements, and a new connection is walked
from the hooked chains: `filter-prerouting-pre-dnat` (loadBalancerSourceRanges: a `drop` there is
the verdict), `nat-prerouting` (DNAT), then `nat-postrouting` per target (masquerade),
or, when nothing DNATed it, `filter-input`/`filter-forward` (reject). Text the tracer cannot read
fails the test (`steps()` raises), so the layout cannot write a rule the tests silently skip.

What it models: `numgen random` is followed into every branch (the trace lists every endpoint a
packet can reach); `numgen inc` takes the next branch, with the counter FakeTable keeps per chain;
`goto` does not return, `jump` does; a verdict-map miss or a `dnat ... map` miss makes the rule not
match. Not modelled: `update @set` (tests seed affinity sets themselves) and conntrack beyond
`ct state new` and `ct status dnat` after DNAT.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from usproxy.offload.nftables.fake import FakeNft, FakeTable
from usproxy.model.types import Family

Step = tuple[str, tuple[str, ...]]  # (what, arguments), parsed from the rule text

# Each pattern matches at the start of what is left of a rule, up to a space or the end.
_STEPS: list[tuple[str, re.Pattern[str]]] = [(what, re.compile(pattern + r"(?: |$)")) for what, pattern in [
    ("fib-local", r"fib daddr type local"),
    ("fib-src-local", r"fib saddr type local"),
    ("iif-not-lo", r"meta iiftype != loopback"),
    ("saddr-net", r"ip6? saddr (!= )?([0-9a-fA-F:.]+/\d+)"),
    ("daddr-not", r"ip6? daddr != (\S+)"),
    ("l4proto", r"meta l4proto (tcp|udp|sctp)"),
    ("tcp-not-syn", r"tcp flags & \(fin \| syn \| rst \| ack\) != syn"),
    ("pair-in-set", r"ip6? saddr \. ip6? daddr @(\S+)"),
    ("key-in-map", r"((?:ip6? [sd]addr|meta l4proto|th dport)(?: \. (?:ip6? [sd]addr|meta l4proto|th dport))+) @(\S+)"),
    ("daddr-in-set", r"ip6? daddr @(\S+)"),
    ("daddr-in", r"ip6? daddr \{ (.*?) \}"),
    ("saddr-not-in", r"ip6? saddr != \{ (.*?) \}"),
    ("saddr-in-set", r"ip6? saddr @(\S+)"),
    ("ct-state", r"ct state (\S+)"),
    ("ct-status", r"ct status (\S+)"),
    ("mark-match", r"meta mark & (0x[0-9a-f]+) == (0x[0-9a-f]+)"),
    ("mark-or", r"meta mark set meta mark \| (0x[0-9a-f]+)"),
    ("mark-xor", r"meta mark set meta mark \^ (0x[0-9a-f]+)"),
    ("masquerade", r"masquerade(?: fully-random)?"),
    ("numgen", r"numgen (random|inc) mod (\d+) vmap \{ (.*?) \}"),
    ("dnat-numgen", r"dnat ip6? to numgen random mod (\d+) map \{ (.*?) \}"),
    ("dnat-map", r"dnat ip6? to (.+?) map @(\S+)"),
    ("dnat", r"dnat ip6? to (?:\[([0-9a-fA-F:.]+)\]|([0-9.]+)):(\d+)"),
    ("vmap", r"(.+?) vmap @(\S+)"),
    ("goto", r"(goto|jump) (\S+)"),
    ("update", r"update @(\S+) \{ .*? \}"),
    ("reject", r"reject(?: with tcp reset)?"),
    ("drop", r"drop"),
    ("return", r"return"),
]]
MASQ_BIT = 0x4000


def steps(rule: str) -> list[Step]:
    """The matches and statements of one rule's text; AssertionError on text it cannot read."""
    out, rest = [], rule
    while rest:
        for what, pattern in _STEPS:
            m = pattern.match(rest)
            if m:
                out.append((what, tuple(g or "" for g in m.groups())))
                rest = rest[m.end():]
                break
        else:
            raise AssertionError(f"the tracer cannot read {rest!r} in rule {rule!r}")
    return out


@dataclass(frozen=True, slots=True)
class Trace:
    """Where a new connection goes: `dnat` to one of `targets` ("ip:port"), `reject`, `drop`, or
    `none` (no usproxy rule took it: the relay or the local stack gets it). `masq`: the targets
    for which nat-postrouting masquerades the source."""

    verdict: str
    targets: frozenset[str] = frozenset()
    masq: frozenset[str] = frozenset()


@dataclass
class _Packet:
    src: str
    dst: str
    proto: str
    dport: int
    local: frozenset[str]
    syn: bool = True  # a TCP packet that opens its connection (False: picked up mid-stream)
    mark: int = 0
    dnat: bool = False

    def value(self, expr: str) -> str:
        """One component of a concatenation key (`ip daddr`, `meta l4proto`, `th dport`)."""
        known = {"ip daddr": self.dst, "ip6 daddr": self.dst, "ip saddr": self.src, "ip6 saddr": self.src,
                 "meta l4proto": self.proto, "th dport": str(self.dport)}
        if expr not in known:
            raise AssertionError(f"the tracer cannot read key {expr!r}")
        return known[expr]

    def key(self, expr: str) -> str:
        return " . ".join(self.value(part) for part in expr.split(" . "))


def trace(nft: FakeNft, family: Family, src: str, dst: str, proto: str, dport: int,
          local: Iterable[str] = (), syn: bool = True, output: bool = False) -> Trace:
    """Follow a new conntrack entry src -> dst:dport (`proto` tcp/udp) through `family`'s table.
    `local` lists this node's addresses (`fib daddr type local`, for NodePorts); `syn=False`:
    a TCP segment of a connection the kernel did not see open, picked up mid-stream; `output`:
    a connection a process on the node opens (the output hooks, not prerouting)."""
    t = nft.tables.get(family)
    if t is None:
        return Trace("none")
    here = frozenset(local)
    pkt = _Packet(src, dst, proto.lower(), dport, here, syn)
    pre_chain, nat_chain = ("filter-output-pre-dnat", "nat-output") if output else (
        "filter-prerouting-pre-dnat", "nat-prerouting")
    pre = _Walk(t).chain(pre_chain, pkt)  # priority -110: before DNAT
    if pre is not None and pre.verdict == "drop":
        return pre
    res = _Walk(t).chain(nat_chain, pkt) or Trace("none")
    if res.verdict == "drop":
        return res
    if res.verdict != "dnat":
        hook = "filter-output" if output else "filter-input" if dst in here else "filter-forward"
        return _Walk(t).chain(hook, _Packet(src, dst, proto.lower(), dport, here, syn)) or Trace("none")
    masq = frozenset(x for x in res.targets if _masqueraded(t, src, x, x in res.masq, here))
    return Trace("dnat", res.targets, masq)


def _masqueraded(t: FakeTable, src: str, target: str, marked: bool, local: frozenset[str]) -> bool:
    """Whether nat-postrouting masquerades the DNATed packet src -> target."""
    ip, port = target.rsplit(":", 1)
    pkt = _Packet(src, ip.strip("[]"), "", int(port), local, mark=MASQ_BIT if marked else 0, dnat=True)
    res = _Walk(t).chain("nat-postrouting", pkt)
    return res is not None and res.verdict == "masquerade"


class _Walk:
    def __init__(self, t: FakeTable) -> None:
        self.t = t
        self.depth = 0

    def chain(self, name: str, pkt: _Packet) -> Trace | None:
        """The verdict of chain `name`; None when the packet falls off its end."""
        self.depth += 1
        if self.depth > 16:
            raise AssertionError(f"chain loop at {name}")
        try:
            for rule in self.t.chains.get(name, []):
                done, res = self._rule(name, steps(rule), pkt)
                if done:
                    return res
            return None
        finally:
            self.depth -= 1

    def _rule(self, chain: str, rule: list[Step], pkt: _Packet) -> tuple[bool, Trace | None]:
        """(True, verdict) when the rule ends the chain (a `goto`, which may fall off the end:
        None); (False, None) when the next rule runs."""
        for what, args in rule:
            if what in _MATCHES:
                if not _MATCHES[what](self.t, pkt, args):
                    return False, None
                continue
            if what in ("mark-or", "mark-xor"):
                bit = int(args[0], 16)
                pkt.mark = pkt.mark | bit if what == "mark-or" else pkt.mark ^ bit
            elif what == "update":
                continue
            else:
                return self._statement(chain, what, args, pkt)
        return False, None

    def _statement(self, chain: str, what: str, args: tuple[str, ...], pkt: _Packet) -> tuple[bool, Trace | None]:
        if what == "return":
            return True, None
        if what in ("masquerade", "reject", "drop"):
            return True, Trace(what)
        if what == "goto":
            return self._jump(args[0], args[1], pkt)
        if what == "vmap":
            found = self.t.maps[args[1]].get(pkt.key(args[0]), (None, None))[0]
            if found is None:
                return False, None
            if found == "drop":  # a verdict element of its own (kube-proxy's Local policies)
                return True, Trace("drop")
            verb, target = found.split()
            return self._jump(verb, target, pkt)
        if what == "numgen":
            return self._numgen(chain, args, pkt)
        if what == "dnat-map":
            found = self.t.maps[args[1]].get(pkt.key(args[0]), (None, None))[0]
            if found is None:
                return False, None
            ip, port = found.split(" . ")
            return True, _dnat(pkt, ip, port)
        if what == "dnat-numgen":  # every branch, as `numgen random ... vmap`
            pairs = [entry.split(" : ")[1].split(" . ") for entry in args[1].split(", ")]
            assert len(pairs) == int(args[0]), f"numgen mod {args[0]} over {pairs}"
            got = [_dnat(copy.deepcopy(pkt), ip, port) for ip, port in pairs]
            pkt.dnat = True
            return True, Trace("dnat", frozenset().union(*(r.targets for r in got)), frozenset().union(*(r.masq for r in got)))
        assert what == "dnat", what
        return True, _dnat(pkt, args[0] or args[1], args[2])

    def _jump(self, verb: str, target: str, pkt: _Packet) -> tuple[bool, Trace | None]:
        res = self.chain(target, pkt)
        if verb == "jump" and res is None:
            return False, None  # back in the calling chain, at its next rule
        return True, res

    def _numgen(self, chain: str, args: tuple[str, ...], pkt: _Packet) -> tuple[bool, Trace | None]:
        branches = [entry.split(" : ") for entry in args[2].split(", ")]
        assert [int(i) for i, _ in branches] == list(range(int(args[1]))), f"numgen mod {args[1]} over {branches}"
        if args[0] == "inc":  # the kernel's per-rule counter: each trace takes the next branch
            n = self.t.counters.get(chain, 0)
            self.t.counters[chain] = n + 1
            verb, target = branches[n % len(branches)][1].split()
            return self._jump(verb, target, pkt)
        results = [self._jump(verb, target, copy.deepcopy(pkt))[1]
                   for verb, target in (branch[1].split() for branch in branches)]
        got = [r for r in results if r is not None]
        if not got:
            return True, None
        return True, Trace("dnat", frozenset().union(*(r.targets for r in got)), frozenset().union(*(r.masq for r in got)))


def _dnat(pkt: _Packet, ip: str, port: str) -> Trace:
    target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    pkt.dnat = True
    return Trace("dnat", frozenset({target}), frozenset({target}) if pkt.mark & MASQ_BIT else frozenset())


def _not_in(t: FakeTable, pkt: _Packet, args: tuple[str, ...]) -> bool:
    return ipaddress.ip_address(pkt.dst) not in ipaddress.ip_network(args[0])


def _saddr_net(t: FakeTable, pkt: _Packet, args: tuple[str, ...]) -> bool:
    inside = ipaddress.ip_address(pkt.src) in ipaddress.ip_network(args[1])
    return inside != bool(args[0])


def _saddr_not_in(t: FakeTable, pkt: _Packet, args: tuple[str, ...]) -> bool:
    src = ipaddress.ip_address(pkt.src)
    return not any(src in ipaddress.ip_network(x.strip()) for x in args[0].split(","))


_MATCHES: dict[str, Callable[[FakeTable, _Packet, tuple[str, ...]], bool]] = {
    "fib-local": lambda t, pkt, a: pkt.dst in pkt.local,
    "fib-src-local": lambda t, pkt, a: pkt.src in pkt.local,
    # a packet from one of `local` is the node's own: in the kernel it meets the nat hooks in
    # output, where `meta iiftype` matches nothing (a local source from the network, a load
    # balancer's hairpin, is not traced here: tests/offload/test_lb_ip_source*.py send it)
    "iif-not-lo": lambda t, pkt, a: pkt.src not in pkt.local,
    "saddr-net": _saddr_net,
    "daddr-not": _not_in,
    "l4proto": lambda t, pkt, a: pkt.proto == a[0],
    "tcp-not-syn": lambda t, pkt, a: pkt.proto == "tcp" and not pkt.syn,
    "saddr-not-in": _saddr_not_in,
    "pair-in-set": lambda t, pkt, a: f"{pkt.src} . {pkt.dst}" in t.sets[a[0]],
    "key-in-map": lambda t, pkt, a: pkt.key(a[0]) in t.maps.get(a[1], t.sets.get(a[1], {})),
    "daddr-in-set": lambda t, pkt, a: pkt.dst in t.sets[a[0]],
    "daddr-in": lambda t, pkt, a: any(ipaddress.ip_address(pkt.dst) in ipaddress.ip_network(n) for n in a[0].split(", ")),
    "saddr-in-set": lambda t, pkt, a: pkt.src in t.sets[a[0]],
    "ct-state": lambda t, pkt, a: a[0] == "new",  # every traced packet opens a connection
    "ct-status": lambda t, pkt, a: a[0] == "dnat" and pkt.dnat,
    "mark-match": lambda t, pkt, a: pkt.mark & int(a[0], 16) == int(a[1], 16),
}
