"""Per datapath: which flows it serves, where it differs from kube-proxy by nature, and which flows
wait for a feature of issue 13.

Datapaths: "relay" (`--offload none`), "nftables" (`--offload nftables`, judged once every
ServicePort is placed there) and "bpf" (`--offload bpf`: the socket LB rewrites connect() and
sendmsg() of processes in its cgroup, so it serves only ClusterIP flows from this node's
processes, node and pods alike; everything else goes to the relay and is judged there), and
"bpf-tc" (the same `--offload bpf` agent, judged on the flows its tc programs serve: an external
client to a NodePort, a LoadBalancer IP or an externalIP; ClusterIPs from outside and every other
source are not tc's and are judged in the other datapaths), and "bpf-tc-dsr" (the same flows, the
agent with `--bpf-lb-mode dsr`, the peer node running one too: lab.py).

Differences by nature (`expectation`):
- relay: it re-originates every connection from the node, so every endpoint sees a node address:
  "masqueraded" whatever kube-proxy expects. Where kube-proxy drops traffic for want of a local
  endpoint (externalTrafficPolicy or internalTrafficPolicy Local), the relay cannot drop on a
  listener it owns: issue 13 item 6 has it refuse instead (REJECT), and /services say so.
  Where kube-proxy drops a client outside loadBalancerSourceRanges, the relay may refuse or stay
  silent ("BLOCKED"): what counts is that no endpoint is reached (issue 13 item 2).
- bpf: no packet is rewritten, the socket connects straight to the endpoint, so the endpoint sees
  the client's own address (never "masqueraded", hairpin included).
- bpf-tc: none. It DNATs and SNATs as kube-proxy (masqueraded for externalTrafficPolicy Cluster,
  the client's address kept for Local), filters loadBalancerSourceRanges by dropping, drops when
  eTP=Local leaves no local endpoint, and refuses a Service without usable endpoints by passing
  the packet to the stack, where no listener answers but the kernel's RST.
- bpf-tc-dsr: as bpf-tc, but a flow to an externalTrafficPolicy Cluster NodePort, LoadBalancer IP
  or externalIP whose endpoint lives on another node (the peer node's pods, addresses.PEER_PODS)
  takes DSR, as Cilium's bpf-lb-mode=dsr: the endpoint gets the client's packet unSNATed, so it
  sees the client's own address where kube-proxy masquerades, and answers the client directly
  with the address and port the client addressed as its source (the probe's connected socket takes
  no other: an answer proves it). The node's own endpoints of the same flow are SNATed as in bpf-tc
  (there is no other node to return from; dsr.h).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.conformance import addresses as A
from tests.conformance.reference import Flow, Scenario

DATAPATHS = ("relay", "nftables", "bpf", "bpf-tc", "bpf-tc-dsr")
TC_DATAPATHS = ("bpf-tc", "bpf-tc-dsr")


@dataclass(frozen=True, slots=True)
class Expectation:
    """`output` as kube-proxy's plus "BLOCKED" (REJECT or DROP); `masq` None: not judged;
    `client_kept`: endpoints of `output` ("ip:port" as kube-proxy writes them) that see the client's
    own address whatever `masq` says of the others."""

    output: str
    masq: bool | None
    why: str = ""  # the reason where this differs from kube-proxy
    client_kept: tuple[str, ...] = ()


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
NO_SERVICE_CIDR_VERDICT = ("only the nftables datapath checks the Service CIDR: with the relay or the socket LB "
                           "alone an unallocated address is routed as the routing table says (here: unreachable)")
RELAY_NO_SHORT_CIRCUIT = ("the relay cannot tell pods and the node from outside clients: an externalTrafficPolicy "
                          "Local frontend gets the local endpoints only (kube-proxy short-circuits them to all)")
DSR_CLIENT_KEPT = ("DSR (as Cilium's bpf-lb-mode=dsr): an endpoint on another node gets the client's packet "
                   "to a NodePort, LB IP or externalIP unSNATed and answers the client directly, so it sees the "
                   "client's address where kube-proxy masquerades (externalTrafficPolicy Cluster); the node's "
                   "own endpoints are SNATed")
BPF_NO_DROP = "the socket LB refuses connect() when a Local policy leaves no endpoint; it cannot drop"

_UNALLOCATED = ("clusterip-general", "packet to unallocated cluster ip")
# flows kube-proxy short-circuits to every endpoint, and the local endpoint the relay picks instead
_RELAY_LOCAL_ONLY = {
    ("etp-local", "pod to external IP hits both endpoints, unmasqueraded"): "10.180.2.1:80",
    ("etp-local", "pod to LB IP hits only both endpoints, unmasqueraded"): "10.180.2.1:80",
    ("etp-local", "pod to NodePort hits both endpoints, unmasqueraded"): "10.180.2.1:80",
    ("only-local-nodeports", "pod to NodePort hits both endpoints"): "10.180.2.1:80",
    **{(k, n): "10.180.0.2:80" for k in ("iem-base", "iem-masqueradeall", "iem-base-nodecidr")
       for n in ("pod to NodePort with eTP:Local", "pod to LB with eTP:Local")},
    **{(k, "node to LB with eTP:Local"): "10.180.0.2:80" for k in
       ("iem-base", "iem-no-localtrafficdetector", "iem-masqueradeall", "iem-masqueradeall-no-localtrafficdetector",
        "iem-base-nodecidr")},
}

# kube-proxy DROPs that come from a traffic policy with no local endpoint (relay: REJECT instead)
_POLICY_DROPS = {("itp-local-none", "no endpoints"),
                 ("terminating-local-remote-terminating", "external to LB")}


def expectation(datapath: str, scenario: Scenario, flow: Flow) -> Expectation:
    served = flow.output not in ("REJECT", "DROP", "", "ACCEPT")
    masq = flow.masq if served else None
    key = (scenario.key, flow.name)
    if datapath in ("relay", "bpf") and key == _UNALLOCATED:
        return Expectation("", None, NO_SERVICE_CIDR_VERDICT)  # no rule matches: routed on
    if datapath == "bpf" and key in _POLICY_DROPS:
        return Expectation("REJECT", None, BPF_NO_DROP)
    if datapath == "relay":
        if key in _RELAY_LOCAL_ONLY:
            return Expectation(_RELAY_LOCAL_ONLY[key], True, RELAY_NO_SHORT_CIRCUIT)
        if key in _POLICY_DROPS:
            return Expectation("REJECT", None, RELAY_NO_DROP)
        if scenario.key == "load-balancer" and flow.output == "DROP":
            return Expectation("BLOCKED", None, RELAY_BLOCKED)
        if served and not flow.masq:
            return Expectation(flow.output, True, RELAY_MASQ)
    if datapath == "bpf" and served and flow.masq:
        return Expectation(flow.output, False, BPF_NO_MASQ)
    if datapath == "bpf-tc-dsr" and served and _cluster_frontend(scenario, flow):
        remote = tuple(e for e in flow.output.split(", ") if A.on_peer_node(A.addr(e.rsplit(":", 1)[0], 1)))
        if remote:
            return Expectation(flow.output, masq, DSR_CLIENT_KEPT, remote)
    return Expectation(flow.output, masq)


def _cluster_frontend(scenario: Scenario, flow: Flow) -> bool:
    """Whether `flow` comes from an external client to a NodePort, LoadBalancer IP or externalIP
    of an externalTrafficPolicy Cluster Service."""
    if not A.is_external_client(A.addr(flow.source, 1)):
        return False
    return any(s.etp == "Cluster" and (p.node_port == flow.port or (
        p.port == flow.port and flow.dest in (*s.lb_ips, *s.external_ips))) for s in scenario.services for p in s.ports)


def serves(datapath: str, source: str, dest: str) -> bool:
    """Whether `datapath` is the one judged for traffic from `source` to `dest` (mapped addresses)."""
    external = source.startswith("203.0.113.")
    if datapath in TC_DATAPATHS:  # the tc programs: external clients to NodePorts, LB IPs, externalIPs
        return external and not dest.startswith("10.96.")
    if datapath != "bpf":
        return True
    return dest.startswith("10.96.") and not external


def pending(datapath: str, scenario: Scenario, flow: Flow) -> Pending | None:
    for p in PENDING:
        if datapath in p.datapaths and any(k in ("*", scenario.key) and n == flow.name for k, n in p.flows):
            return p
    return None


PENDING: tuple[Pending, ...] = ()
