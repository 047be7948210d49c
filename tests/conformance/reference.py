"""kube-proxy's packet-flow expectations, transcribed as data (addresses as kube-proxy writes them).

Source: kubernetes/kubernetes pkg/proxy/nftables/proxier_test.go (every `runPacketFlowTests` call
of TestNoEndpointsReject, TestClusterIPGeneral, TestLoadBalancer, TestNodePorts (IPv4 cases),
TestExternalTrafficPolicyLocal/Cluster, TestInternalTrafficPolicy,
TestTerminatingEndpointsTrafficPolicyLocal/Cluster, TestInternalExternalMasquerade with its four
proxier configurations) and pkg/proxy/iptables/proxier_test.go (TestHealthCheckNodePort,
TestOnlyLocalNodePorts, TestOnlyLocalNodePortsNoClusterCIDR). Facts only: the Services, the
EndpointSlices, and per flow the source, destination, expected output and masquerade bit, with
kube-proxy's own names. No Go code.

Shapes: a `Scenario` is one kube-proxy test (or subtest): Services, EndpointSlices and `Flow`s.
`Flow.output` is kube-proxy's: "ip:port, ip:port" (the set of endpoints that may answer),
"REJECT", "DROP", "" (no rule matches) or "ACCEPT" (a health check NodePort answers). Flows of
`phase` 1 run after the scenario's `after` change ("slices-deleted" or "service-deleted"). The
kube-proxy fake proxier's settings a scenario relies on are in `Group` (its node name is
"test-node"; pod CIDR 10.0.0.0/8; nodePortAddresses 192.168.0.2/32 unless the test changes them).

Addresses are mapped into this machine's test ranges by tests/conformance/addresses.py; which
flows a datapath serves, and where it differs from kube-proxy by nature, is in
tests/conformance/datapaths.py; flows that wait for a feature of issue 13 are in `PENDING` below.
Not transcribed: the IPv6 cases of TestNodePorts (the netns topology is IPv4 only), the SCTP flow
of TestClusterIPGeneral (usproxy serves no SCTP: the relay refuses it, the kernel datapaths do not
install it), and TestOnlyLocalNodePorts' "pod to localhost" (a pod's 127.0.0.1 is its own
loopback in a real network namespace: no packet reaches the node).
"""

from __future__ import annotations

from dataclasses import dataclass

NODE = "test-node"  # kube-proxy's testNodeName
NODE_IP, NODE_IP_ALT = "192.168.0.2", "192.168.1.2"  # testNodeIP, testNodeIPAlt
EXT_CLIENT, EXT_BLOCKED = "203.0.113.2", "203.0.113.130"  # testExternalClient(Blocked)
POD = "10.0.0.2"  # the usual client pod


@dataclass(frozen=True, slots=True)
class Port:
    """A Service port (node_port 0: none; target_port None: same as port) or an EndpointSlice port."""

    name: str
    port: int
    protocol: str = "TCP"
    node_port: int = 0
    target_port: int | None = None


@dataclass(frozen=True, slots=True)
class Svc:
    namespace: str
    name: str
    cluster_ip: str
    ports: tuple[Port, ...]
    type: str = "ClusterIP"
    etp: str = "Cluster"
    itp: str = "Cluster"
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    source_ranges: tuple[str, ...] = ()
    hc_node_port: int = 0


@dataclass(frozen=True, slots=True)
class Ep:
    """An EndpointSlice endpoint; conditions None are left out of the manifest (ready by default)."""

    ip: str
    node: str | None = None
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


@dataclass(frozen=True, slots=True)
class Slice:
    namespace: str
    service: str
    endpoints: tuple[Ep, ...]
    ports: tuple[Port, ...]


@dataclass(frozen=True, slots=True)
class Flow:
    name: str
    source: str
    dest: str
    port: int
    output: str
    masq: bool = False
    protocol: str = "TCP"
    phase: int = 0


@dataclass(frozen=True, slots=True)
class Scenario:
    """One kube-proxy test or subtest; `key` is unique and names it in test ids."""

    key: str
    test: str
    services: tuple[Svc, ...]
    slices: tuple[Slice, ...]
    flows: tuple[Flow, ...]
    after: str | None = None  # "slices-deleted" | "service-deleted": the change before phase 1


@dataclass(frozen=True, slots=True)
class Group:
    """Scenarios that share one agent: kube-proxy fake-proxier settings they all use."""

    key: str
    scenarios: tuple[Scenario, ...]
    nodeport_addresses: tuple[str, ...] = (f"{NODE_IP}/32",)
    masquerade_all: bool = False
    local_detector: bool = True  # kube-proxy's DetectLocalByCIDR("10.0.0.0/8"); False: NoOp detector
    node_cidr: bool = False  # the detector's CIDR from the Node's spec.podCIDRs (detectLocalMode NodeCIDR)
    localhost_nodeports: bool | None = None  # iptables.localhostNodePorts (None: not set, kube-proxy's true)


def _eps(*ips: str) -> str:
    return ", ".join(f"{ip}:80" for ip in ips)


P80 = (Port("p80", 80),)


# -- nftables TestNoEndpointsReject -------------------------------------------------------------
NO_ENDPOINTS = Scenario(
    "no-endpoints", "TestNoEndpointsReject",
    (Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001),), type="LoadBalancer",
         external_ips=("192.168.99.11",), lb_ips=("1.2.3.4",)),),
    (),
    (Flow("pod to cluster IP with no endpoints", POD, "172.30.0.41", 80, "REJECT"),
     Flow("external to external IP with no endpoints", EXT_CLIENT, "192.168.99.11", 80, "REJECT"),
     Flow("pod to NodePort with no endpoints", POD, NODE_IP, 3001, "REJECT"),
     Flow("external to NodePort with no endpoints", EXT_CLIENT, NODE_IP, 3001, "REJECT"),
     Flow("pod to LoadBalancer IP with no endpoints", POD, "1.2.3.4", 80, "REJECT"),
     Flow("external to LoadBalancer IP with no endpoints", EXT_CLIENT, "1.2.3.4", 80, "REJECT")))

# -- nftables TestClusterIPGeneral (the SCTP flow left out, see the module docstring) -------------
_SVC2_PORTS = (Port("http", 80), Port("https", 443, target_port=8443), Port("dns-udp", 53, "UDP"),
               Port("dns-tcp", 53, target_port=5353))
CLUSTER_IP_GENERAL = Scenario(
    "clusterip-general", "TestClusterIPGeneral",
    (Svc("ns1", "svc1", "172.30.0.41", (Port("http", 80),)),
     Svc("ns2", "svc2", "172.30.0.42", _SVC2_PORTS)),
    (Slice("ns1", "svc1", (Ep("10.180.0.1", NODE),), (Port("http", 80),)),
     Slice("ns2", "svc2", (Ep("10.180.0.1", NODE), Ep("10.180.2.1", "node2")),
           (Port("http", 80), Port("https", 8443), Port("dns-udp", 53, "UDP"), Port("dns-tcp", 5353)))),
    (Flow("simple clusterIP", "10.180.0.2", "172.30.0.41", 80, "10.180.0.1:80"),
     Flow("hairpin to cluster IP", "10.180.0.1", "172.30.0.41", 80, "10.180.0.1:80", masq=True),
     Flow("clusterIP with multiple endpoints", "10.180.0.2", "172.30.0.42", 80, "10.180.0.1:80, 10.180.2.1:80"),
     Flow("clusterIP with TargetPort", "10.180.0.2", "172.30.0.42", 443, "10.180.0.1:8443, 10.180.2.1:8443"),
     Flow("clusterIP with TCP, UDP, and SCTP on same port (TCP)", "10.180.0.2", "172.30.0.42", 53,
          "10.180.0.1:5353, 10.180.2.1:5353"),
     Flow("clusterIP with TCP, UDP, and SCTP on same port (UDP)", "10.180.0.2", "172.30.0.42", 53,
          "10.180.0.1:53, 10.180.2.1:53", protocol="UDP"),
     Flow("TCP-only port does not match UDP traffic", "10.180.0.2", "172.30.0.42", 80, "REJECT", protocol="UDP"),
     Flow("svc1 does not accept svc2's ports", "10.180.0.2", "172.30.0.41", 443, "REJECT"),
     Flow("packet to unallocated cluster ip", "10.180.0.2", "172.30.0.50", 80, "DROP")))

# -- nftables TestLoadBalancer --------------------------------------------------------------------
_LB = ("1.2.3.4", "5.6.7.8")
LOAD_BALANCER = Scenario(
    "load-balancer", "TestLoadBalancer",
    (Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001),), type="LoadBalancer",
         lb_ips=_LB, source_ranges=("192.168.0.0/24", " 203.0.113.0/25")),),
    (Slice("ns1", "svc1", (Ep("10.180.0.1"),), P80),),
    (Flow("pod to cluster IP", POD, "172.30.0.41", 80, "10.180.0.1:80"),
     Flow("external to nodePort", EXT_CLIENT, NODE_IP, 3001, "10.180.0.1:80", masq=True),
     Flow("nodePort bypasses LoadBalancerSourceRanges", EXT_BLOCKED, NODE_IP, 3001, "10.180.0.1:80", masq=True),
     Flow("accepted external to LB1", EXT_CLIENT, _LB[0], 80, "10.180.0.1:80", masq=True),
     Flow("accepted external to LB2", EXT_CLIENT, _LB[1], 80, "10.180.0.1:80", masq=True),
     Flow("blocked external to LB1", EXT_BLOCKED, _LB[0], 80, "DROP"),
     Flow("blocked external to LB2", EXT_BLOCKED, _LB[1], 80, "DROP"),
     Flow("pod to LB1 (blocked by LoadBalancerSourceRanges)", POD, _LB[0], 80, "DROP"),
     Flow("pod to LB2 (blocked by LoadBalancerSourceRanges)", POD, _LB[1], 80, "DROP"),
     Flow("node to LB1 (allowed by LoadBalancerSourceRanges)", NODE_IP, _LB[0], 80, "10.180.0.1:80", masq=True),
     Flow("node to LB2 (allowed by LoadBalancerSourceRanges)", NODE_IP, _LB[1], 80, "10.180.0.1:80", masq=True),
     Flow("same node to LB1, SNATted to LB1 (implicitly allowed)", _LB[0], _LB[0], 80, "10.180.0.1:80", masq=True),
     Flow("same node to LB2, SNATted to LB2 (implicitly allowed)", _LB[1], _LB[1], 80, "10.180.0.1:80", masq=True)))


# -- nftables TestNodePorts (IPv4 cases) ----------------------------------------------------------
def _node_ports(key: str, alt_allowed: bool) -> Scenario:
    both = "10.180.0.1:80, 10.180.2.1:80"
    alt = (Flow("external to nodePort on secondary IP", EXT_CLIENT, NODE_IP_ALT, 3001, both, masq=True)
           if alt_allowed else Flow("secondary nodeIP ignores NodePorts", EXT_CLIENT, NODE_IP_ALT, 3001, ""))
    return Scenario(
        key, "TestNodePorts/" + ("ipv4, multiple nodeport-addresses" if alt_allowed else "ipv4"),
        (Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001),), type="NodePort"),),
        (Slice("ns1", "svc1", (Ep("10.180.0.1"), Ep("10.180.2.1", NODE)), P80),),
        (Flow("pod to cluster IP", POD, "172.30.0.41", 80, both),
         Flow("external to nodePort", EXT_CLIENT, NODE_IP, 3001, both, masq=True),
         Flow("node to nodePort", NODE_IP, NODE_IP, 3001, both, masq=True),
         alt))


NODE_PORTS = _node_ports("nodeports", False)
NODE_PORTS_MULTI = _node_ports("nodeports-multi", True)

# -- nftables TestExternalTrafficPolicyLocal / Cluster --------------------------------------------
_ETP_EPS = (Slice("ns1", "svc1", (Ep("10.180.0.1"), Ep("10.180.2.1", NODE)), P80),)


def _etp_svc(etp: str) -> Svc:
    return Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001, target_port=80),),
               type="LoadBalancer", etp=etp, external_ips=("192.168.99.11",), lb_ips=("1.2.3.4",),
               hc_node_port=30000 if etp == "Local" else 0)


_BOTH = "10.180.0.1:80, 10.180.2.1:80"
ETP_LOCAL = Scenario(
    "etp-local", "TestExternalTrafficPolicyLocal", (_etp_svc("Local"),), _ETP_EPS,
    (Flow("pod to cluster IP hits both endpoints, unmasqueraded", POD, "172.30.0.41", 80, _BOTH),
     Flow("pod to external IP hits both endpoints, unmasqueraded", POD, "192.168.99.11", 80, _BOTH),
     Flow("external to external IP hits only local endpoint, unmasqueraded", EXT_CLIENT, "192.168.99.11", 80,
          "10.180.2.1:80"),
     Flow("pod to LB IP hits only both endpoints, unmasqueraded", POD, "1.2.3.4", 80, _BOTH),
     Flow("external to LB IP hits only local endpoint, unmasqueraded", EXT_CLIENT, "1.2.3.4", 80, "10.180.2.1:80"),
     Flow("pod to NodePort hits both endpoints, unmasqueraded", POD, NODE_IP, 3001, _BOTH),
     Flow("external to NodePort hits only local endpoint, unmasqueraded", EXT_CLIENT, NODE_IP, 3001,
          "10.180.2.1:80")))
ETP_CLUSTER = Scenario(
    "etp-cluster", "TestExternalTrafficPolicyCluster", (_etp_svc("Cluster"),), _ETP_EPS,
    (Flow("pod to cluster IP hits both endpoints, unmasqueraded", POD, "172.30.0.41", 80, _BOTH),
     Flow("pod to external IP hits both endpoints, masqueraded", POD, "192.168.99.11", 80, _BOTH, masq=True),
     Flow("external to external IP hits both endpoints, masqueraded", EXT_CLIENT, "192.168.99.11", 80, _BOTH,
          masq=True),
     Flow("pod to LB IP hits both endpoints, masqueraded", POD, "1.2.3.4", 80, _BOTH, masq=True),
     Flow("external to LB IP hits both endpoints, masqueraded", EXT_CLIENT, "1.2.3.4", 80, _BOTH, masq=True),
     Flow("pod to NodePort hits both endpoints, masqueraded", POD, NODE_IP, 3001, _BOTH, masq=True),
     Flow("external to NodePort hits both endpoints, masqueraded", EXT_CLIENT, NODE_IP, 3001, _BOTH, masq=True)))


# -- nftables TestInternalTrafficPolicy -----------------------------------------------------------
def _itp(key: str, subtest: str, itp: str, eps: tuple[tuple[str, str], ...], flow: Flow) -> Scenario:
    svc = Svc("ns1", "svc1", "172.30.1.1", (Port("", 80),), itp=itp)
    sl = Slice("ns1", "svc1", tuple(Ep(ip, node, ready=True) for ip, node in eps), (Port("", 80),))
    deleted = Flow("endpoints deleted", POD, "172.30.1.1", 80, "REJECT", phase=1)
    return Scenario(key, f"TestInternalTrafficPolicy/{subtest}", (svc,), (sl,), (flow, deleted), "slices-deleted")


ITP = (
    _itp("itp-cluster", "internalTrafficPolicy is cluster", "Cluster",
         (("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")),
         Flow("pod to ClusterIP hits all endpoints", POD, "172.30.1.1", 80, _eps("10.0.1.1", "10.0.1.2", "10.0.1.3"))),
    _itp("itp-local-one", "internalTrafficPolicy is local and there is one local endpoint", "Local",
         (("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")),
         Flow("pod to ClusterIP hits only local endpoint", POD, "172.30.1.1", 80, "10.0.1.1:80")),
    _itp("itp-local-many", "internalTrafficPolicy is local and there are multiple local endpoints", "Local",
         (("10.0.1.1", NODE), ("10.0.1.2", NODE), ("10.0.1.3", "node2")),
         Flow("pod to ClusterIP hits all local endpoints", POD, "172.30.1.1", 80, _eps("10.0.1.1", "10.0.1.2"))),
    _itp("itp-local-none", "internalTrafficPolicy is local and there are no local endpoints", "Local",
         (("10.0.1.1", "node0"), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")),
         Flow("no endpoints", POD, "172.30.1.1", 80, "DROP")),
)


# -- nftables TestTerminatingEndpointsTrafficPolicyLocal / Cluster --------------------------------
_ST, _T, _R = "serving-terminating", "terminating", "ready"
# per test and subtest: (short key, subtest name, endpoints as (ip, nodeName, state))
_TERM_EPS: dict[str, tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...]] = {
    "Local": (
        ("ready", "ready endpoints exist", (("10.0.1.1", NODE, _R), ("10.0.1.2", NODE, _R), ("10.0.1.3", NODE, _ST),
                                           ("10.0.1.4", NODE, _T), ("10.0.1.5", "node-1", _R))),
        ("only-terminating", "only terminating endpoints exist",
         (("10.0.1.2", NODE, _ST), ("10.0.1.3", NODE, _ST), ("10.0.1.4", NODE, _T), ("10.0.1.5", "node-1", _R))),
        ("remote-terminating", "terminating endpoints on remote node", (("10.0.1.5", "node-1", _ST),)),
        ("no-usable", "no usable endpoints on any node", (("10.0.1.5", NODE, _T), ("10.0.1.5", "node-1", _T))),
    ),
    "Cluster": (
        ("ready", "ready endpoints exist",
         (("10.0.1.1", NODE, _R), ("10.0.1.2", NODE, _R), ("10.0.1.3", "another-node", _ST),
          ("10.0.1.4", "another-node", _T), ("10.0.1.5", "another-node", _R))),
        ("only-terminating", "only terminating endpoints exist",
         (("10.0.1.2", NODE, _ST), ("10.0.1.3", NODE, _ST), ("10.0.1.4", "another-node", _T),
          ("10.0.1.5", "another-node", _ST))),
        ("remote-terminating", "terminating endpoints on remote node", (("10.0.1.5", "node-1", _ST),)),
        ("no-usable", "no usable endpoints on any node", (("10.0.1.5", NODE, _T), ("10.0.1.5", "node-1", _T))),
    ),
}
# per test and subtest: (pod to clusterIP, external to LB, external to LB masqueraded)
_TERM_FLOWS: dict[str, dict[str, tuple[str, str, bool]]] = {
    "Local": {"ready": (_eps("10.0.1.1", "10.0.1.2", "10.0.1.5"), _eps("10.0.1.1", "10.0.1.2"), False),
              "only-terminating": ("10.0.1.5:80", _eps("10.0.1.2", "10.0.1.3"), False),
              "remote-terminating": ("10.0.1.5:80", "DROP", False),
              "no-usable": ("REJECT", "REJECT", False)},
    "Cluster": {"ready": (_eps("10.0.1.1", "10.0.1.2", "10.0.1.5"), _eps("10.0.1.1", "10.0.1.2", "10.0.1.5"), True),
                "only-terminating": (_eps("10.0.1.2", "10.0.1.3", "10.0.1.5"),
                                     _eps("10.0.1.2", "10.0.1.3", "10.0.1.5"), True),
                "remote-terminating": ("10.0.1.5:80", "10.0.1.5:80", True),
                "no-usable": ("REJECT", "REJECT", False)},
}


def _terminating(etp: str) -> tuple[Scenario, ...]:
    out = []
    for short, subtest, eps in _TERM_EPS[etp]:
        endpoints = tuple(Ep(ip, node, *_CONDITIONS[state]) for ip, node, state in eps)
        svc = Svc("ns1", "svc1", "172.30.1.1", (Port("", 80, target_port=80),), type="LoadBalancer", etp=etp,
                  lb_ips=("1.2.3.4",), hc_node_port=30000)
        pod_out, ext_out, ext_masq = _TERM_FLOWS[etp][short]
        flows = (Flow("pod to clusterIP", POD, "172.30.1.1", 80, pod_out),
                 Flow("external to LB", EXT_CLIENT, "1.2.3.4", 80, ext_out, masq=ext_masq),
                 Flow("pod to clusterIP after endpoints deleted", POD, "172.30.1.1", 80, "REJECT", phase=1),
                 Flow("external to LB after endpoints deleted", EXT_CLIENT, "1.2.3.4", 80, "REJECT", phase=1))
        out.append(Scenario(f"terminating-{etp.lower()}-{short}", f"TestTerminatingEndpointsTrafficPolicy{etp}/{subtest}",
                            (svc,), (Slice("ns1", "svc1", endpoints, (Port("", 80),)),), flows, "slices-deleted"))
    return tuple(out)


_CONDITIONS = {_R: (True, True, False), _ST: (False, True, True), _T: (False, False, True)}  # ready, serving, terminating
TERMINATING_LOCAL = _terminating("Local")
TERMINATING_CLUSTER = _terminating("Cluster")


# -- nftables TestInternalExternalMasquerade ------------------------------------------------------
def _iem_services() -> tuple[tuple[Svc, ...], tuple[Slice, ...]]:
    svcs, slices = [], []
    # svc1 plain, svc2 externalTrafficPolicy Local, svc3 internalTrafficPolicy Local
    for i, (lb, etp, itp) in enumerate((("1.2.3.4", "Cluster", "Cluster"), ("5.6.7.8", "Local", "Cluster"),
                                        ("9.10.11.12", "Cluster", "Local")), start=1):
        svcs.append(Svc(f"ns{i}", f"svc{i}", f"172.30.0.4{i}", (Port("p80", 80, node_port=3000 + i),),
                        type="LoadBalancer", etp=etp, itp=itp, lb_ips=(lb,), hc_node_port=30000 + i))
        slices.append(Slice(f"ns{i}", f"svc{i}", (Ep(f"10.180.0.{i}", NODE), Ep(f"10.180.1.{i}", "remote")), P80))
    return tuple(svcs), tuple(slices)


def _pair(i: int) -> str:
    return f"10.180.0.{i}:80, 10.180.1.{i}:80"


# (name, source, dest, port, output, masq) for the "base" case; the other cases override below
_IEM_BASE: tuple[tuple[str, str, str, int, str, bool], ...] = (
    ("pod to ClusterIP", POD, "172.30.0.41", 80, _pair(1), False),
    ("pod to NodePort", POD, NODE_IP, 3001, _pair(1), True),
    ("pod to LB", POD, "1.2.3.4", 80, _pair(1), True),
    ("node to ClusterIP", NODE_IP, "172.30.0.41", 80, _pair(1), True),
    ("node to NodePort", NODE_IP, NODE_IP, 3001, _pair(1), True),
    ("node to LB", NODE_IP, "1.2.3.4", 80, _pair(1), True),
    ("external to ClusterIP", EXT_CLIENT, "172.30.0.41", 80, _pair(1), True),
    ("external to NodePort", EXT_CLIENT, NODE_IP, 3001, _pair(1), True),
    ("external to LB", EXT_CLIENT, "1.2.3.4", 80, _pair(1), True),
    ("pod to ClusterIP with eTP:Local", POD, "172.30.0.42", 80, _pair(2), False),
    ("pod to NodePort with eTP:Local", POD, NODE_IP, 3002, _pair(2), False),
    ("pod to LB with eTP:Local", POD, "5.6.7.8", 80, _pair(2), False),
    ("node to ClusterIP with eTP:Local", NODE_IP, "172.30.0.42", 80, _pair(2), True),
    ("node to NodePort with eTP:Local", NODE_IP, NODE_IP, 3001, _pair(1), True),  # sic: 3001 in kube-proxy
    ("node to LB with eTP:Local", NODE_IP, "5.6.7.8", 80, _pair(2), True),
    ("external to ClusterIP with eTP:Local", EXT_CLIENT, "172.30.0.42", 80, _pair(2), True),
    ("external to NodePort with eTP:Local", EXT_CLIENT, NODE_IP, 3002, "10.180.0.2:80", False),
    ("external to LB with eTP:Local", EXT_CLIENT, "5.6.7.8", 80, "10.180.0.2:80", False),
    ("pod to ClusterIP with iTP:Local", POD, "172.30.0.43", 80, "10.180.0.3:80", False),
    ("pod to NodePort with iTP:Local", POD, NODE_IP, 3003, _pair(3), True),
    ("pod to LB with iTP:Local", POD, "9.10.11.12", 80, _pair(3), True),
    ("node to ClusterIP with iTP:Local", NODE_IP, "172.30.0.43", 80, "10.180.0.3:80", True),
    ("node to NodePort with iTP:Local", NODE_IP, NODE_IP, 3003, _pair(3), True),
    ("node to LB with iTP:Local", NODE_IP, "9.10.11.12", 80, _pair(3), True),
    ("external to ClusterIP with iTP:Local", EXT_CLIENT, "172.30.0.43", 80, "10.180.0.3:80", True),
    ("external to NodePort with iTP:Local", EXT_CLIENT, NODE_IP, 3003, _pair(3), True),
    ("external to LB with iTP:Local", EXT_CLIENT, "9.10.11.12", 80, _pair(3), True),
)
_NO_DETECTOR: dict[str, tuple[str | None, bool | None]] = {  # name -> (output, masq) overrides
    "node to ClusterIP": (None, False), "node to ClusterIP with eTP:Local": (None, False),
    "node to ClusterIP with iTP:Local": (None, False), "external to ClusterIP": (None, False),
    "external to ClusterIP with eTP:Local": (None, False), "external to ClusterIP with iTP:Local": (None, False),
    "pod to NodePort with eTP:Local": ("10.180.0.2:80", None), "pod to LB with eTP:Local": ("10.180.0.2:80", None),
}
_MASQ_ALL: dict[str, tuple[str | None, bool | None]] = {
    "pod to ClusterIP": (None, True), "pod to ClusterIP with eTP:Local": (None, True),
    "pod to ClusterIP with iTP:Local": (None, True),
}


def _iem(case: str, *overrides: dict[str, tuple[str | None, bool | None]]) -> Scenario:
    merged: dict[str, tuple[str | None, bool | None]] = {}
    for o in overrides:
        merged.update(o)
    flows = []
    for name, src, dst, port, output, masq in _IEM_BASE:
        new_out, new_masq = merged.get(name, (None, None))
        flows.append(Flow(name, src, dst, port, output if new_out is None else new_out,
                          masq if new_masq is None else new_masq))
    svcs, slices = _iem_services()
    return Scenario(f"iem-{case.replace(', ', '-').replace(' ', '-').lower()}",
                    f"TestInternalExternalMasquerade/{case}", svcs, slices, tuple(flows))


IEM_BASE = _iem("base")
IEM_NO_DETECTOR = _iem("no LocalTrafficDetector", _NO_DETECTOR)
IEM_MASQ_ALL = _iem("masqueradeAll", _MASQ_ALL)
# kube-proxy's DetectLocalByCIDR is one detector whichever mode gave its CIDR (getLocalDetectors,
# cmd/kube-proxy/app/server_linux.go): with detectLocalMode NodeCIDR and the Node's podCIDRs
# holding the pods, every flow is as in "base" (the agent is given a clusterCIDR holding no pod,
# which NodeCIDR must ignore)
IEM_NODE_CIDR = _iem("base, NodeCIDR")
# masqueradeAll marks every ClusterIP connection, detector or not: of "no LocalTrafficDetector" only
# its eTP:Local outputs apply here (its node/external "not masqueraded" flows are what masqueradeAll
# changes back)
IEM_MASQ_ALL_NO_DETECTOR = _iem("masqueradeAll, no LocalTrafficDetector",
                                {k: v for k, v in _NO_DETECTOR.items() if v[1] is None}, _MASQ_ALL)


# -- iptables TestHealthCheckNodePort, TestOnlyLocalNodePorts(NoClusterCIDR) -----------------------
HEALTH_CHECK = Scenario(
    "healthcheck-nodeport", "TestHealthCheckNodePort (iptables)",
    (Svc("ns1", "svc1", "172.30.0.42", (Port("p80", 80, node_port=3001),), type="LoadBalancer", etp="Local",
         hc_node_port=30000),),
    (),
    # kube-proxy's source here is 1.2.3.4, an outside client: it is EXT_CLIENT's role
    (Flow("firewall accepts HealthCheckNodePort", EXT_CLIENT, NODE_IP, 30000, "ACCEPT"),
     Flow("HealthCheckNodePort no longer has any rule", EXT_CLIENT, NODE_IP, 30000, "", phase=1)),
    "service-deleted")


def _only_local(key: str, detector: bool) -> Scenario:
    pod_np = (Flow("pod to NodePort hits both endpoints", POD, NODE_IP, 3001, _BOTH) if detector else
              Flow("pod to NodePort hits only local endpoint", POD, NODE_IP, 3001, "10.180.2.1:80"))
    return Scenario(
        key, "TestOnlyLocalNodePorts (iptables)" if detector else "TestOnlyLocalNodePortsNoClusterCIDR (iptables)",
        (Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001),), type="NodePort", etp="Local"),),
        (Slice("ns1", "svc1", (Ep("10.180.0.1"), Ep("10.180.2.1", NODE)), P80),),
        (Flow("pod to cluster IP hit both endpoints", POD, "172.30.0.41", 80, _BOTH),
         Flow("external to NodePort hits only local endpoint", EXT_CLIENT, NODE_IP, 3001, "10.180.2.1:80"),
         pod_np))


ONLY_LOCAL_NODE_PORTS = _only_local("only-local-nodeports", True)
ONLY_LOCAL_NODE_PORTS_NO_DETECTOR = _only_local("only-local-nodeports-no-detector", False)

# -- iptables: pkg/proxy/iptables/proxier_test.go ------------------------------------------------
# Its runPacketFlowTests calls, for the iptables datapath. TestNoEndpointsReject, TestLoadBalancer,
# TestExternalTrafficPolicyLocal/Cluster, TestInternalTrafficPolicy, TestTerminatingEndpoints*
# and TestHealthCheckNodePort have the very Services, slices and flows of the scenarios above (a few
# flow names differ in wording only); these differ:
# - TestClusterIPGeneral: a port the ClusterIP does not serve matches no rule ("", where nftables
#   rejects), there is no unallocated-ClusterIP flow, and an SCTP flow (left out as above);
# - TestNodePorts: NodePorts on every local address (the fake proxier's nodePortAddresses is nil),
#   localhost NodePorts, in four IPv4 cases of --iptables-localhost-nodeports and nodePortAddresses;
# - TestInternalExternalMasquerade: three more flows, to a NodePort on 127.0.0.1.
# Not transcribed: TestTracePackets (it tests the tracer on hand-written rules, no Service), the
# IPv6 cases of TestNodePorts (the lab is IPv4).
_IPT_UNSERVED = {"TCP-only port does not match UDP traffic": "", "svc1 does not accept svc2's ports": ""}
CLUSTER_IP_GENERAL_IPT = Scenario(
    "ipt-clusterip-general", "TestClusterIPGeneral (iptables)", CLUSTER_IP_GENERAL.services,
    CLUSTER_IP_GENERAL.slices,
    tuple(Flow(f.name, f.source, f.dest, f.port, _IPT_UNSERVED.get(f.name, f.output), f.masq, f.protocol)
          for f in CLUSTER_IP_GENERAL.flows if f.name != "packet to unallocated cluster ip"))


def _ipt_node_ports(key: str, subtest: str, localhost: bool, alt_allowed: bool) -> Scenario:
    both = "10.180.0.1:80, 10.180.2.1:80"
    lo = (Flow("localhost to nodePort gets masqueraded", "127.0.0.1", "127.0.0.1", 3001, both, masq=True)
          if localhost else Flow("localhost to nodePort is ignored", "127.0.0.1", "127.0.0.1", 3001, ""))
    alt = (Flow("external to nodePort on secondary IP", EXT_CLIENT, NODE_IP_ALT, 3001, both, masq=True)
           if alt_allowed else Flow("secondary nodeIP ignores NodePorts", EXT_CLIENT, NODE_IP_ALT, 3001, ""))
    return Scenario(
        key, f"TestNodePorts (iptables)/{subtest}",
        (Svc("ns1", "svc1", "172.30.0.41", (Port("p80", 80, node_port=3001),), type="NodePort"),),
        (Slice("ns1", "svc1", (Ep("10.180.0.1"), Ep("10.180.2.1", NODE)), P80),),
        (Flow("pod to cluster IP", POD, "172.30.0.41", 80, both),
         Flow("external to nodePort", EXT_CLIENT, NODE_IP, 3001, both, masq=True),
         Flow("node to nodePort", NODE_IP, NODE_IP, 3001, both, masq=True),
         lo, alt))


IPT_NODE_PORTS = _ipt_node_ports("ipt-nodeports", "ipv4, localhost-nodeports enabled", True, True)
IPT_NODE_PORTS_NO_LOCALHOST = _ipt_node_ports("ipt-nodeports-no-localhost", "ipv4, localhost-nodeports disabled",
                                              False, True)
IPT_NODE_PORTS_LOCALHOST_CIDR = _ipt_node_ports(
    "ipt-nodeports-localhost-cidr", "ipv4, localhost-nodeports disabled, localhost in nodeport-addresses", False, False)
IPT_NODE_PORTS_MULTI = _ipt_node_ports(
    "ipt-nodeports-multi", "ipv4, localhost-nodeports enabled, multiple nodeport-addresses", False, True)

# TestInternalExternalMasquerade's flows to a NodePort on 127.0.0.1, each after the node's flow
_IPT_LOCALHOST = {"node to NodePort": ("localhost to NodePort", 3001, _pair(1)),
                  "node to NodePort with eTP:Local": ("localhost to NodePort with eTP:Local", 3002, _pair(2)),
                  "node to NodePort with iTP:Local": ("localhost to NodePort with iTP:Local", 3003, _pair(3))}


def _ipt_iem(base: Scenario) -> Scenario:
    flows = []
    for f in base.flows:
        flows.append(f)
        if f.name in _IPT_LOCALHOST:
            name, port, output = _IPT_LOCALHOST[f.name]
            flows.append(Flow(name, "127.0.0.1", "127.0.0.1", port, output, masq=True))
    return Scenario("ipt-" + base.key, base.test + " (iptables)", base.services, base.slices, tuple(flows))


# -- the agents ----------------------------------------------------------------------------------
GROUPS: tuple[Group, ...] = (
    Group("base", (NO_ENDPOINTS, CLUSTER_IP_GENERAL, LOAD_BALANCER, NODE_PORTS, ETP_LOCAL, ETP_CLUSTER, *ITP,
                   *TERMINATING_LOCAL, *TERMINATING_CLUSTER, IEM_BASE, HEALTH_CHECK, ONLY_LOCAL_NODE_PORTS)),
    # TestNodePorts' second case; TestOnlyLocalNodePorts' 192.168.0.0/24 serves the same flows as base
    Group("nodeport-addresses", (NODE_PORTS_MULTI,), nodeport_addresses=("192.168.0.0/24", "192.168.1.0/24")),
    Group("no-detector", (IEM_NO_DETECTOR, ONLY_LOCAL_NODE_PORTS_NO_DETECTOR), local_detector=False),
    Group("masquerade-all", (IEM_MASQ_ALL,), masquerade_all=True),
    Group("node-cidr", (IEM_NODE_CIDR,), node_cidr=True),
    Group("masquerade-all-no-detector", (IEM_MASQ_ALL_NO_DETECTOR,), masquerade_all=True, local_detector=False),
)

# The iptables datapath's agents, as the iptables fake proxier: NodePorts on every local address,
# localhost NodePorts on (unless the group says otherwise)
_ALL: tuple[str, ...] = ()
IPTABLES_GROUPS: tuple[Group, ...] = (
    Group("ipt-base", (NO_ENDPOINTS, CLUSTER_IP_GENERAL_IPT, LOAD_BALANCER, IPT_NODE_PORTS, ETP_LOCAL, ETP_CLUSTER,
                       *ITP, *TERMINATING_LOCAL, *TERMINATING_CLUSTER, _ipt_iem(IEM_BASE), HEALTH_CHECK),
          nodeport_addresses=_ALL),
    Group("ipt-no-localhost", (IPT_NODE_PORTS_NO_LOCALHOST,), nodeport_addresses=_ALL, localhost_nodeports=False),
    Group("ipt-localhost-cidr", (IPT_NODE_PORTS_LOCALHOST_CIDR,), nodeport_addresses=("192.168.0.0/24", "127.0.0.1/32"),
          localhost_nodeports=False),
    Group("ipt-nodeport-addresses", (IPT_NODE_PORTS_MULTI,),
          nodeport_addresses=("192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"), localhost_nodeports=False),
    Group("ipt-no-detector", (_ipt_iem(IEM_NO_DETECTOR),), nodeport_addresses=_ALL, local_detector=False),
    Group("ipt-masquerade-all", (_ipt_iem(IEM_MASQ_ALL),), nodeport_addresses=_ALL, masquerade_all=True),
    Group("ipt-node-cidr", (_ipt_iem(IEM_NODE_CIDR),), nodeport_addresses=_ALL, node_cidr=True),
    Group("ipt-masquerade-all-no-detector", (_ipt_iem(IEM_MASQ_ALL_NO_DETECTOR),), nodeport_addresses=_ALL,
          masquerade_all=True, local_detector=False),
)
ALL_GROUPS: tuple[Group, ...] = (*GROUPS, *IPTABLES_GROUPS)
