"""The chains kube-proxy's iptables mode owns, by table, and how its per-ServicePort chains are
told from everyone else's (pkg/proxy/iptables/proxier.go isServiceChainName).

KUBE-FIREWALL is also kubelet's (its duplicate of the rule blocking martian localnet packets),
and the hint chains are only kubelet's: usproxy writes the first and never touches the others.
KUBE-PROXY-CANARY is the empty chain kube-proxy's iptables monitor keeps in mangle, nat and
filter: when a firewall reload flushes the tables, its absence says so.
"""

from __future__ import annotations

from usproxy.offload.iptables.rules import EXTERNAL_SERVICES, MARK_MASQ, NODEPORTS, POSTROUTING, PROXY_FIREWALL, SERVICES

FORWARD = "KUBE-FORWARD"
FIREWALL = "KUBE-FIREWALL"  # kubelet's too
CANARY = "KUBE-PROXY-CANARY"
CANARY_TABLES = ("mangle", "nat", "filter")
KUBELET_HINTS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")  # kubelet's, in mangle
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")
TOP_NAT = (SERVICES, NODEPORTS, POSTROUTING, MARK_MASQ)  # rewritten by every sync
TOP_FILTER = (SERVICES, EXTERNAL_SERVICES, FORWARD, NODEPORTS, PROXY_FIREWALL, FIREWALL)
__all__ = ["CANARY", "CANARY_TABLES", "EXTERNAL_SERVICES", "FIREWALL", "FORWARD", "KUBELET_HINTS", "MARK_MASQ",
           "NODEPORTS", "POSTROUTING", "PROXY_FIREWALL", "SERVICES", "SERVICE_CHAIN_PREFIXES", "TOP_FILTER",
           "TOP_NAT", "is_service_chain", "owned"]


def is_service_chain(name: str) -> bool:
    """One ServicePort's own chain (KUBE-SVC-, -SVL-, -EXT-, -FW-, -SEP-)."""
    return name.startswith(SERVICE_CHAIN_PREFIXES)


def owned(table: str, chain: str) -> bool:
    """Whether `chain` of `table` is one kube-proxy's iptables mode (and so usproxy) writes."""
    if chain == CANARY:
        return table in CANARY_TABLES
    if table == "nat":
        return chain in TOP_NAT or is_service_chain(chain)
    return table == "filter" and chain in TOP_FILTER
