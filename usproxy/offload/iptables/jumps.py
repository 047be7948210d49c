"""The entry jumps: how packets get from the kernel's built-in chains into kube-proxy's chains.

kube-proxy's iptables mode does not write these with iptables-restore (it must not own PREROUTING,
OUTPUT, ...): on every full sync it makes sure each one exists with `iptables -I` (EnsureRule
Prepend), as the list iptablesJumpChains (then kubelet's iptablesKubeletJumpChains, for
KUBE-FIREWALL) in pkg/proxy/iptables/proxier.go says. Each rule reads
`[-m conntrack --ctstate NEW] [-m comment --comment "..."] -j <chain>`.

Invariant: `listed` returns them in the order `iptables-save` shows them: tables filter then nat,
built-in chains in the kernel's order, and within one built-in chain the reverse of the order they
were inserted (each insert goes to the top). A jump appears only when its target chain is
declared, so the view never shows a jump iptables would refuse.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

Table = Literal["filter", "nat"]  # the iptables tables kube-proxy writes (iptables.py builds them)


@dataclass(frozen=True, slots=True)
class Jump:
    """One entry jump: `-A <base> ... -j <target>` in `table`."""

    table: Table
    base: str
    target: str
    comment: str
    new_only: bool  # -m conntrack --ctstate NEW: only the first packet of a connection

    def text(self) -> str:
        state = "-m conntrack --ctstate NEW " if self.new_only else ""
        comment = f'-m comment --comment "{self.comment}" ' if self.comment else ""
        return f"-A {self.base} {state}{comment}-j {self.target}"


PORTALS = "kubernetes service portals"
EXTERNAL = "kubernetes externally-visible service portals"
FIREWALL = "kubernetes load balancer firewall"

# In the order kube-proxy ensures them (iptablesJumpChains, then iptablesKubeletJumpChains).
JUMPS: tuple[Jump, ...] = (
    Jump("filter", "INPUT", "KUBE-EXTERNAL-SERVICES", EXTERNAL, True),
    Jump("filter", "FORWARD", "KUBE-EXTERNAL-SERVICES", EXTERNAL, True),
    Jump("filter", "INPUT", "KUBE-NODEPORTS", "kubernetes health check service ports", False),
    Jump("filter", "FORWARD", "KUBE-SERVICES", PORTALS, True),
    Jump("filter", "OUTPUT", "KUBE-SERVICES", PORTALS, True),
    Jump("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules", False),
    Jump("filter", "INPUT", "KUBE-PROXY-FIREWALL", FIREWALL, True),
    Jump("filter", "OUTPUT", "KUBE-PROXY-FIREWALL", FIREWALL, True),
    Jump("filter", "FORWARD", "KUBE-PROXY-FIREWALL", FIREWALL, True),
    Jump("nat", "OUTPUT", "KUBE-SERVICES", PORTALS, False),
    Jump("nat", "PREROUTING", "KUBE-SERVICES", PORTALS, False),
    Jump("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules", False),
    Jump("filter", "INPUT", "KUBE-FIREWALL", "", False),
    Jump("filter", "OUTPUT", "KUBE-FIREWALL", "", False),
)
# Not kube-proxy's: usproxy's relay holds every ClusterIP as a local address (usproxy0), so a
# packet to one is delivered locally and passes filter INPUT, where kube-proxy's iptables mode
# (whose ClusterIPs are not local: FORWARD) has no jump to KUBE-SERVICES. Without this one, its
# DROP and REJECT rules for ClusterIPs would not apply to pods and outside clients. The iptables
# datapath inserts it with the others; explain does not show it (it renders kube-proxy's rules).
LOCAL_CLUSTER_IPS = Jump("filter", "INPUT", "KUBE-SERVICES", "usproxy: ClusterIPs are local addresses", True)
DATAPATH_JUMPS: tuple[Jump, ...] = (*JUMPS, LOCAL_CLUSTER_IPS)
BUILTIN: dict[Table, tuple[str, ...]] = {  # the built-in chains, in the order iptables-save lists them
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
}


def listed(declared: Mapping[Table, Collection[str]]) -> list[Jump]:
    """The jumps to chains `declared` (table -> chain names), in iptables-save order."""
    present = [j for j in JUMPS if j.target in declared.get(j.table, ())]
    out: list[Jump] = []
    for table, bases in BUILTIN.items():
        for base in bases:
            out += reversed([j for j in present if j.table == table and j.base == base])
    return out


def render(declared: Mapping[Table, Collection[str]]) -> str:
    """The jumps as an iptables-save excerpt (one block per table), or "" when there are none."""
    jumps = listed(declared)
    lines = []
    for table in BUILTIN:
        rules = [j.text() for j in jumps if j.table == table]
        if rules:
            lines += [f"*{table}", *rules, "COMMIT"]
    return "\n".join(lines) + "\n" if lines else ""


def header(tool: str) -> str:
    """The comment that introduces the jumps in the iptables view."""
    return (f"# entry jumps: kube-proxy inserts these at the top of the built-in chains with `{tool} -I` "
            "on every full sync\n# (iptablesJumpChains, pkg/proxy/iptables/proxier.go), outside the "
            "restore input above; `iptables-save` lists them so:\n")
