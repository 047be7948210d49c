"""The chains kube-proxy's iptables and IPVS modes both write, and which mode holds them now.

Both modes name some of their chains alike: nat KUBE-SERVICES, KUBE-POSTROUTING, KUBE-MARK-MASQ and
filter KUBE-FORWARD, KUBE-PROXY-FIREWALL (pkg/proxy/iptables/proxier.go, pkg/proxy/ipvs/proxier.go).
One node runs one mode at a time, and a mode's first full sync rewrites these chains with its own
rules; so when an agent removes the leftovers of the mode it does not run, the shared chains are
removed only if the other mode does not hold them: its signature in that table is absent.

Signatures, from what only that mode writes in the table: iptables mode, a chain of its own
(KUBE-NODEPORTS, KUBE-SVC-*, KUBE-EXT-*, ...) or a rule jumping to one; IPVS mode, one of its own
chains (KUBE-LOAD-BALANCER, KUBE-NODE-PORT, KUBE-IPVS-FILTER, ...) or a rule matching one of its
ipsets (`--match-set KUBE-`).
"""

from __future__ import annotations

from typing import Literal

from usproxy.offload.iptables.saved import SavedTable

Mode = Literal["iptables", "ipvs"]
SHARED: dict[str, frozenset[str]] = {
    "nat": frozenset({"KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"}),
    "filter": frozenset({"KUBE-FORWARD", "KUBE-PROXY-FIREWALL"}),
}
_IPTABLES_OWN = ("KUBE-NODEPORTS", "KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-",
                 "KUBE-EXTERNAL-SERVICES")
_IPVS_OWN = ("KUBE-LOAD-BALANCER", "KUBE-NODE-PORT", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER",
             "KUBE-IPVS-OUT-FILTER")


def holds(table: SavedTable, mode: Mode) -> bool:
    """Whether `mode`'s signature is in `table` (module docstring)."""
    if mode == "iptables":
        own = [c for c in table.user_chains() if c.startswith(_IPTABLES_OWN)]
        return bool(own) or any((r.target or "").startswith(_IPTABLES_OWN) for r in table.rules)
    if any(c in _IPVS_OWN for c in table.user_chains()):
        return True
    return any("--match-set KUBE-" in r.spec for r in table.rules)


def kept(table_name: str, table: SavedTable, other: Mode) -> frozenset[str]:
    """The shared chains of `table` that the `other` mode holds (not to be removed)."""
    return SHARED.get(table_name, frozenset()) if holds(table, other) else frozenset()


def jump_texts(mode: Mode) -> frozenset[str]:
    """The entry jumps `mode` inserts, as text (some read the same in both modes)."""
    if mode == "iptables":
        from usproxy.offload.iptables.jumps import DATAPATH_JUMPS

        return frozenset(j.text() for j in DATAPATH_JUMPS)
    from usproxy.offload.ipvs.rules import JUMPS

    return frozenset(j.text() for j in JUMPS)
