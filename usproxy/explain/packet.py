"""The first packet of a new connection, and one path it may take through a mode's rules.

`Packet` is what a tracer reads: addresses, port, protocol and whether the source and the
destination are addresses of this node (kube-proxy's tracers take the node's addresses for
`fib saddr type local` / `-m addrtype --src-type LOCAL`), and whether the source is known to be a
pod on this node (`src_pod`, with why: usproxy/explain/pod_source.py). `Path` is one way through the rules with
its exact share of new connections (`fractions.Fraction`); its invariants: `walked` holds the text
of every rendered rule evaluated, in order, so `rules == len(walked)` counts only rules the mode's
view lists; `hops` are the ones that matched (plus map lookups and the tracer's own notes);
the hops list every one of them, as matched or in runs of "no match" (`matched + skipped ==
rules` for rule walks), besides lookups and notes; `lands` is the outcome in the vocabulary of kube-proxy's packet-flow tests
(pkg/proxy/nftables/helpers_test.go tracePacket): "ip:port" of an endpoint, "REJECT", "DROP", or ""
when no Service rule handled the packet; "ERROR" when the rules jump to a chain they never declare
(iptables-restore or nft would refuse them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from usproxy.util.errors import ConfigError
from usproxy.model.service_set import ServiceSet
from usproxy.model.types import IPAddress, parse_ip_sloppy


@dataclass(frozen=True, slots=True)
class Packet:
    """The first packet of a new connection."""

    src: IPAddress
    dst: IPAddress
    dport: int
    proto: str  # "TCP", "UDP", "SCTP"
    src_local: bool = False
    dst_local: bool = False
    src_pod: str = ""  # why SRC is a pod on this node (a process the BPF socket LB serves); "" if not known

    @property
    def p(self) -> str:
        return self.proto.lower()


@dataclass
class Path:
    """One way through the rules: its share of new connections, its hops and where it lands."""

    share: Fraction = Fraction(1)
    hops: list[str] = field(default_factory=list)
    walked: list[str] = field(default_factory=list)
    lookups: int = 0
    matched: int = 0  # rules listed in `hops` as matched
    skipped: int = 0  # rules listed in `hops` as tested without a match ("rules 1-4: no match")
    result: str = ""
    lands: str = ""
    masquerade: bool = False
    run: tuple[str, int, int] | None = None  # the "no match" run `hops[-1]` lists: (chain, first, last)
    seen: str = ""  # the source the backend sees, where it is not what `masquerade` implies (the relay)
    aside: str = ""  # a second outcome the same walk tells, in a phrase (userspace: kube-proxy 1.0's)

    @property
    def rules(self) -> int:
        """Rendered rules evaluated for the first packet."""
        return len(self.walked)

    def hit(self, hop: str) -> None:
        """List a rule that matched."""
        self.hops.append(hop)
        self.matched += 1
        self.run = None

    def miss(self, chain: str, i: int) -> None:
        """List rule `i` of `chain` as tested without a match, merged into a run of such rules."""
        self.skipped += 1
        if self.run is not None and self.run[0] == chain and self.run[2] == i - 1:
            self.run = (chain, self.run[1], i)
            self.hops[-1] = f"{chain} rules {self.run[1]}-{i}: no match"
            return
        self.run = (chain, i, i)
        self.hops.append(f"{chain} rule {i}: no match")

    def note(self, hop: str) -> None:
        """List a lookup or an explanation (not a rule)."""
        self.hops.append(hop)
        self.run = None

    def fork(self, share: Fraction) -> Path:
        return Path(self.share * share, list(self.hops), list(self.walked), self.lookups,
                    self.matched, self.skipped, self.result, self.lands, self.masquerade, self.run,
                    self.seen, self.aside)


def parse_packet(src: str, dst: str, ss: ServiceSet) -> Packet:
    """SRC and "DST:PORT[/PROTO]" (IPv6 as "[addr]:port/proto"). Raises ConfigError. The packet
    is not marked as a pod's (`src_pod`): the caller knows what the input says about SRC."""
    try:
        target, _, proto = dst.rpartition("/") if "/" in dst else (dst, "", "TCP")
        host, _, port = target.rpartition(":")
        d = parse_ip_sloppy(host.strip("[]"))  # as the agent reads addresses (IPv4-mapped: IPv4)
        s = parse_ip_sloppy(src)
        n = int(port)
    except ValueError:
        raise ConfigError("expected SRC DST:PORT[/PROTO] (TCP when left out), e.g. 10.0.0.5 10.96.0.10:53/UDP",
                          obj="trace", field=f"{src} {dst}") from None
    if not 0 < n < 65536:
        raise ConfigError(f"port must be between 1 and 65535, got {n}", obj="trace", field=dst)
    if proto.upper() not in ("TCP", "UDP", "SCTP"):
        raise ConfigError(f"protocol must be TCP, UDP or SCTP, got {proto!r}", obj="trace", field=dst)
    if s.version != d.version:
        raise ConfigError("source and destination are of different IP families", obj="trace",
                          field=f"{src} {dst}")
    local = set(ss.node.ips)
    return Packet(s, d, n, proto.upper(), s in local, d in local or d.is_loopback)
