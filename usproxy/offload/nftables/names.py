"""Names in usproxy's nftables tables: the table, its maps and chains, and element comments.

Pure functions of their arguments. Shared structures have fixed names (`service-ips`, `slot-<i>`,
`g-<n>`, ...); chains of one ServicePort's own (affinity, round robin, firewall) are named from a hash of its
ServicePortName, as kube-proxy's nftables mode names its per-service chains
(pkg/proxy/nftables/proxier.go hashAndTruncate). A verdict element's comment is the
ServicePortName key, which is how read back attributes kernel state to ServicePorts.

A comment is the only text of the layout that comes from input (names: validated as DNS-1123 at
parsing), and nft has no escape inside a quoted string: `safe_comment` keeps comments to an
alphabet that cannot close the quote or start a new command, whatever reaches this layer.
"""

from __future__ import annotations

import re
from typing import Literal, TypeAlias

from usproxy.util.name_hash import name_hash
from usproxy.model.types import Family, Scope, ServicePortName

Kind: TypeAlias = Literal["ip", "np"]

TABLE = "usproxy"
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit
COMMENT_MAX = 127  # nft element comments hold at most 128 bytes with the NUL
_COMMENT_UNSAFE = re.compile(r"[^A-Za-z0-9._:/ -]")


def safe_comment(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9._:/ -] replaced by "_", at most
    COMMENT_MAX bytes: safe between nft's double quotes (no quote, newline, ';', '#', '{')."""
    return _COMMENT_UNSAFE.sub("_", text)[:COMMENT_MAX]


def nft_family(family: Family) -> str:
    return "ip" if family == 4 else "ip6"


def addr_type(family: Family) -> str:
    return "ipv4_addr" if family == 4 else "ipv6_addr"


def short_hash(text: str) -> str:
    """8 base32 characters of sha256, as kube-proxy's hashAndTruncate prefix (lower case)."""
    return name_hash(text, 8).lower()


def verdict_map(kind: Kind, empty: bool) -> str:
    if empty:
        return "no-endpoint-services" if kind == "ip" else "no-endpoint-nodeports"
    return "service-ips" if kind == "ip" else "service-nodeports"


def slot_map(kind: Kind, i: int) -> str:
    return f"slot-{i}" if kind == "ip" else f"np-slot-{i}"


def slot_chain(kind: Kind, i: int) -> str:
    return f"s-{i}" if kind == "ip" else f"nps-{i}"


# kind, masquerade (m: all, x: what the local-traffic detector says is not from a pod), count
GROUP_CHAIN = re.compile(r"^(g|npg)(m|x)?-(\d+)$")


def group_chain(kind: Kind, n: int, masq: bool, nonlocal_only: bool = False) -> str:
    mark = ("x" if nonlocal_only else "m") if masq else ""
    return f"{'g' if kind == 'ip' else 'npg'}{mark}-{n}"


def affinity_chain(spn: ServicePortName, scope: Scope) -> str:
    return f"aff-{short_hash(spn.key())}-{scope[0]}"


def rr_chain(spn: ServicePortName, scope: Scope, kind: Kind) -> str:
    """The round-robin chain of one ServicePort's scope, per frontend kind (ClusterIP/external
    IPs, or NodePort: their slot chains differ)."""
    return f"rr-{short_hash(spn.key())}-{scope[0]}{'' if kind == 'ip' else 'n'}"


def short_circuit_chain(spn: ServicePortName, kind: Kind) -> str:
    """The externalTrafficPolicy Local chain of one ServicePort's external frontends of `kind`:
    pod and node traffic to all endpoints, the rest to the local ones (commands.short_circuit_rules)."""
    return f"xl-{short_hash(spn.key())}{'' if kind == 'ip' else 'n'}"


def short_circuit_pick(spn: ServicePortName) -> str:
    """The chain that DNATs short-circuited traffic to one of every endpoint (both kinds share it)."""
    return f"xs-{short_hash(spn.key())}"


FIREWALL_MAP = "firewall-ips"  # LB IP . proto . port : goto fw-<hash> (kube-proxy's firewall-ips)


def firewall_chain(spn: ServicePortName) -> str:
    """The loadBalancerSourceRanges chain of one ServicePort (kube-proxy's firewall-<hash>-...):
    it drops a new connection from a source outside the ranges."""
    return f"fw-{short_hash(spn.key())}"


def affinity_endpoint(spn: ServicePortName, scope: Scope, hostport: str) -> str:
    """Name of the endpoint chain and of its client-address set (they share it); `hostport` is
    the endpoint as Target.hostport() writes it ("ip:port", "[ip6]:port")."""
    return f"ep-{short_hash(spn.key())}-{scope[0]}-{short_hash(hostport)}"


EXTERNAL_SUFFIX = " external"


def comment_of(spn: ServicePortName, scope: Scope) -> str:
    """The verdict element's comment: the ServicePortName, and which traffic the frontend takes."""
    suffix = EXTERNAL_SUFFIX if scope == "external" else ""
    return safe_comment(spn.key())[:COMMENT_MAX - len(suffix)] + suffix


def parse_comment(comment: str) -> tuple[ServicePortName | None, Scope]:
    """Inverse of comment_of (None: the comment names no ServicePort, say one cut at 127 bytes)."""
    if comment.endswith(EXTERNAL_SUFFIX):
        return ServicePortName.from_key(comment[: -len(EXTERNAL_SUFFIX)]), "external"
    return ServicePortName.from_key(comment), "cluster"
