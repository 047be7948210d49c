"""Per datapath: which flows it serves, where it differs from kube-proxy by nature, and which flows
wait for a feature of issue 13.

Datapaths: "relay" (`--offload none`), "nftables" (`--offload nftables`, judged once every
ServicePort is placed there) and "bpf" (`--offload bpf`: the socket LB rewrites connect() and
sendmsg() of processes in its cgroup, so it serves only ClusterIP flows from this node's
processes, node and pods alike; everything else goes to the relay and is judged there), and
"iptables" (`--offload iptables`, judged once every ServicePort is placed there, on kube-proxy's
iptables expectations: reference.IPTABLES_GROUPS), "iptables-legacy" (the same, kubelet's hint
chain in iptables-legacy first, so the agent picks that backend), "bpf-tc" (the same `--offload bpf` agent,
judged on the flows its tc programs serve: an external
client to a NodePort, a LoadBalancer IP or an externalIP; ClusterIPs from outside and every other
source are not tc's and are judged in the other datapaths), and "bpf-tc-dsr" (the same flows, the
agent with `--bpf-lb-mode dsr`, the peer node running one too: lab.py).

Differences by nature (`expectation`):
- iptables: none. It runs kube-proxy's own rules; where they match nothing (a port a ClusterIP does
  not serve, "" in kube-proxy's tests) the packet reaches the node, which holds the ClusterIP on
  usproxy0 and refuses it: still no endpoint answers, which is what "" asks.
- relay: it re-originates every connection from the node, so every endpoint sees a node address:
  "masqueraded" whatever kube-proxy expects (tests/conformance/test_relay_masquerade.py shows why
  this cannot be closed without kernel NAT). Everything else is as kube-proxy: it drops where
  kube-proxy drops (socket filters on its listeners, a blackhole route for unallocated Service CIDR
  addresses) and short-circuits pods and the node to every endpoint of an externalTrafficPolicy
  Local Service (it tells them by the peer of each connection).
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
from tests.conformance.reference import GROUPS, IPTABLES_GROUPS, Flow, Group, Scenario

DATAPATHS = ("relay", "nftables", "bpf", "bpf-tc", "bpf-tc-dsr", "iptables", "iptables-legacy")
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
BPF_NO_MASQ = "the socket LB rewrites connect(): no packet NAT, the endpoint sees the client's own address"
DSR_CLIENT_KEPT = ("DSR (as Cilium's bpf-lb-mode=dsr): an endpoint on another node gets the client's packet "
                   "to a NodePort, LB IP or externalIP unSNATed and answers the client directly, so it sees the "
                   "client's address where kube-proxy masquerades (externalTrafficPolicy Cluster); the node's "
                   "own endpoints are SNATed")
BPF_NO_DROP = "the socket LB refuses connect() when a Local policy leaves no endpoint; it cannot drop"

# kube-proxy DROPs that come from a traffic policy with no local endpoint (the socket LB refuses instead)
_POLICY_DROPS = {("itp-local-none", "no endpoints"),
                 ("terminating-local-remote-terminating", "external to LB")}


def expectation(datapath: str, scenario: Scenario, flow: Flow) -> Expectation:
    served = flow.output not in ("REJECT", "DROP", "", "ACCEPT")
    masq = flow.masq if served else None
    key = (scenario.key, flow.name)
    if datapath == "bpf" and key in _POLICY_DROPS:
        return Expectation("REJECT", None, BPF_NO_DROP)
    if datapath == "relay" and served and not flow.masq:
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


def groups_of(datapath: str) -> tuple[Group, ...]:
    """The scenarios a datapath is judged on: kube-proxy's iptables tests for the iptables
    datapath, its nftables tests (and the iptables-only ones the others share) for the rest."""
    return IPTABLES_GROUPS if datapath.startswith("iptables") else GROUPS


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
