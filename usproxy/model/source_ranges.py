"""loadBalancerSourceRanges: which clients may reach a Service's LoadBalancer IPs.

Parsed from `spec.loadBalancerSourceRanges` as kube-proxy does (pkg/proxy/serviceport.go
newBaseServiceInfo with pkg/proxy/util MapCIDRsByIPFamily): each entry has its surrounding
whitespace trimmed, host bits are allowed (203.0.113.7/25 means 203.0.113.0/25, as
ParseCIDRSloppy), and an entry that is not a CIDR is logged and ignored; the Service itself is
still served. kube-proxy reads only the spec field (not the cloud providers'
service.beta.kubernetes.io/load-balancer-source-ranges annotation), and so does usproxy.

Per IP family, as kube-proxy's per-family proxiers: ranges of the other family are ignored, a
zero-length prefix (0.0.0.0/0, ::/0) means "allow any" (the same as no ranges), and when a range
holds one of the node's own addresses the LoadBalancer IPs themselves are allowed as sources too
(a node reaching a VIP-style LB IP is looped back with the LB IP as its source; kube-proxy's
nftables `allowFromNode`). Every datapath that serves a LoadBalancer IP enforces the same
`allowed_sources()`: nftables drops, the relay resets or drops before dialing an endpoint.
Only LoadBalancer IPs are filtered: ClusterIPs, externalIPs and NodePorts are not (as kube-proxy).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Iterable

from usproxy.model.types import IPAddress, IPNetwork, parse_cidr_sloppy

log = logging.getLogger(__name__)



def parse_source_ranges(obj: str, field: str, texts: Iterable[str]) -> tuple[IPNetwork, ...]:
    """The valid CIDRs of `texts` (both families, in order, duplicates dropped). A bad entry is
    logged as "<obj>: <field>[i]: ..." and ignored, as kube-proxy ("Invalid CIDR ignored")."""
    out: list[IPNetwork] = []
    for i, raw in enumerate(texts):
        text = raw.strip()
        try:
            net = parse_cidr_sloppy(text)  # leading zeros as kube-proxy (ParseCIDRSloppy)
        except ValueError:
            if text:
                log.warning("%s: %s[%d]: not a valid CIDR: %r, ignored", obj, field, i, raw)
            continue
        if net not in out:
            out.append(net)
    return tuple(out)


def family_ranges(ranges: Iterable[IPNetwork], family: int) -> tuple[IPNetwork, ...]:
    """The ranges that filter `family` (4 or 6): empty means no filtering, also when one of them
    is 0.0.0.0/0 or ::/0 (kube-proxy: a zero-masked CIDR means allow any)."""
    mine = tuple(n for n in ranges if n.version == family)
    return () if any(n.prefixlen == 0 for n in mine) else mine


def allowed_sources(ranges: Iterable[IPNetwork], family: int, lb_ips: Iterable[IPAddress],
                    node_ips: Collection[IPAddress]) -> tuple[IPNetwork, ...]:
    """Sources allowed to reach this family's LoadBalancer IPs `lb_ips` (empty: everyone is):
    the family's ranges, plus each LB IP as a host route when a range holds a node address."""
    mine = family_ranges(ranges, family)
    if not mine:
        return ()
    if any(ip in n for n in mine for ip in node_ips if ip.version == family):
        extra = [ipaddress.ip_network(ip) for ip in lb_ips if ip.version == family]
        mine += tuple(n for n in extra if n not in mine)
    return mine


def allows(sources: tuple[IPNetwork, ...], client: IPAddress) -> bool:
    """Whether `client` may reach an LB IP filtered by `sources` (from allowed_sources)."""
    return not sources or any(client in n for n in sources)
