"""Per datapath: which flows it serves, where it differs from kube-proxy by nature, and which flows
wait for a feature of issue 13.

Datapaths: "relay" (`--offload none`), "nftables" (`--offload nftables`, judged once every
ServicePort is placed there) and "bpf" (`--offload bpf`: the socket LB rewrites connect() and
sendmsg() of processes in its cgroup, so it serves only ClusterIP flows from this node's
processes, node and pods alike; everything else goes to the relay and is judged there).

Differences by nature (`expectation`):
- relay: it re-originates every connection from the node, so every endpoint sees a node address:
  "masqueraded" whatever kube-proxy expects. Where kube-proxy drops traffic for want of a local
  endpoint (externalTrafficPolicy or internalTrafficPolicy Local), the relay cannot drop on a
  listener it owns: issue 13 item 6 has it refuse instead (REJECT), and /services say so.
  Where kube-proxy drops a client outside loadBalancerSourceRanges, the relay may refuse or stay
  silent ("BLOCKED"): what counts is that no endpoint is reached (issue 13 item 2).
- bpf: no packet is rewritten, the socket connects straight to the endpoint, so the endpoint sees
  the client's own address (never "masqueraded", hairpin included).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.conformance.reference import Flow, Scenario

DATAPATHS = ("relay", "nftables", "bpf")


@dataclass(frozen=True, slots=True)
class Expectation:
    """`output` as kube-proxy's plus "BLOCKED" (REJECT or DROP); `masq` None: not judged."""

    output: str
    masq: bool | None
    why: str = ""  # the reason where this differs from kube-proxy


@dataclass(frozen=True, slots=True)
class Pending:
    """Flows waiting for a feature of issue 13 in some datapaths: xfail(strict)."""

    item: int
    feature: str
    datapaths: tuple[str, ...]
    flows: tuple[tuple[str, str], ...]  # (scenario key, flow name); ("*", name) any scenario

    def reason(self) -> str:
        return f"{self.feature} (issue 13 item {self.item})"


RELAY_MASQ = "the relay re-originates every connection from the node"
RELAY_NO_DROP = "the relay cannot drop on a listener it owns: it refuses (issue 13 item 6)"
RELAY_BLOCKED = "the relay keeps a client outside loadBalancerSourceRanges from every endpoint, refused or silent"
BPF_NO_MASQ = "the socket LB rewrites connect(): no packet NAT, the endpoint sees the client's own address"

# kube-proxy DROPs that come from a traffic policy with no local endpoint (relay: REJECT instead)
_POLICY_DROPS = {("itp-local-none", "no endpoints"),
                 ("terminating-local-remote-terminating", "external to LB")}


def expectation(datapath: str, scenario: Scenario, flow: Flow) -> Expectation:
    served = flow.output not in ("REJECT", "DROP", "", "ACCEPT")
    masq = flow.masq if served else None
    if datapath == "relay":
        if (scenario.key, flow.name) in _POLICY_DROPS:
            return Expectation("REJECT", None, RELAY_NO_DROP)
        if scenario.key == "load-balancer" and flow.output == "DROP":
            return Expectation("BLOCKED", None, RELAY_BLOCKED)
        if served and not flow.masq:
            return Expectation(flow.output, True, RELAY_MASQ)
    if datapath == "bpf" and served and flow.masq:
        return Expectation(flow.output, False, BPF_NO_MASQ)
    return Expectation(flow.output, masq)


def serves(datapath: str, source: str, dest: str) -> bool:
    """Whether `datapath` is the one judged for traffic from `source` to `dest` (mapped addresses)."""
    if datapath != "bpf":
        return True
    return dest.startswith("10.96.") and not source.startswith("203.0.113.")


def pending(datapath: str, scenario: Scenario, flow: Flow) -> Pending | None:
    for p in PENDING:
        if datapath in p.datapaths and any(k in ("*", scenario.key) and n == flow.name for k, n in p.flows):
            return p
    return None


_KERNEL = ("relay", "nftables")
_IEM = ("iem-base", "iem-no-localtrafficdetector", "iem-masqueradeall", "iem-masqueradeall-no-localtrafficdetector")
_TO_CLUSTER_IP = ("to ClusterIP", "to ClusterIP with eTP:Local", "to ClusterIP with iTP:Local")

PENDING: tuple[Pending, ...] = (
    Pending(2, "loadBalancerSourceRanges", _KERNEL, tuple(
        ("load-balancer", n) for n in ("blocked external to LB1", "blocked external to LB2",
                                       "pod to LB1 (blocked by LoadBalancerSourceRanges)",
                                       "pod to LB2 (blocked by LoadBalancerSourceRanges)"))),
    Pending(4, "Service CIDR: unallocated ClusterIPs dropped", DATAPATHS,
            (("clusterip-general", "packet to unallocated cluster ip"),)),
    Pending(5, "nodeport-addresses in nftables", ("nftables",), (("nodeports", "secondary nodeIP ignores NodePorts"),)),
    Pending(6, "externalTrafficPolicy Local short-circuit for pod and node sources", _KERNEL, (
        ("etp-local", "pod to external IP hits both endpoints, unmasqueraded"),
        ("etp-local", "pod to LB IP hits only both endpoints, unmasqueraded"),
        ("etp-local", "pod to NodePort hits both endpoints, unmasqueraded"),
        ("only-local-nodeports", "pod to NodePort hits both endpoints"),
        *((k, n) for k in ("iem-base", "iem-masqueradeall") for n in ("pod to NodePort with eTP:Local",
                                                                      "pod to LB with eTP:Local")),
        *((k, "node to LB with eTP:Local") for k in _IEM))),
    Pending(6, "DROP for no local endpoints (traffic policy Local)", ("nftables", "bpf"), (
        ("itp-local-none", "no endpoints"), ("terminating-local-remote-terminating", "external to LB"))),
    Pending(7, "masquerade local-traffic detector", ("nftables",), tuple(
        ("iem-base", f"{src} {dst}") for src in ("node", "external") for dst in _TO_CLUSTER_IP)),
    Pending(7, "masqueradeAll", ("nftables",), (
        *(("iem-masqueradeall", f"{src} {dst}") for src in ("pod", "node", "external") for dst in _TO_CLUSTER_IP),
        *(("iem-masqueradeall-no-localtrafficdetector", f"pod {dst}") for dst in _TO_CLUSTER_IP))),
)
