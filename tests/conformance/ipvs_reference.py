"""kube-proxy's IPVS expectations, transcribed as data (kube-proxy's own addresses and names).

Source: kubernetes/kubernetes pkg/proxy/ipvs/proxier_test.go, the tests that say what IPVS mode
installs: TestNodePortIPv4, TestIPv4Proxier, TestExternalIPsNoEndpoint, TestExternalIPs,
TestOnlyLocalExternalIPs, TestLoadBalancer, TestOnlyLocalNodePorts, TestHealthCheckNodePort,
TestLoadBalancerSourceRanges, TestAcceptIPVSTraffic, TestOnlyLocalLoadBalancing,
TestSessionAffinity, TestMultiPortServiceBindAddr, TestEndpointSliceE2E,
TestTestInternalTrafficPolicyE2E, Test_EndpointSliceReadyAndTerminatingCluster/Local,
Test_EndpointSliceOnlyReadyAndTerminatingCluster/Local. Facts only: Services, endpoints, the
fake proxier's node addresses, and per case the virtual servers with their real servers, the
ipset entries and the iptables rules (jump target and matched set, in order, as checkIptables
compares them: the nat chain then the filter chain of the same name). No Go code.

Two uses: tests/conformance/test_ipvs_reference.py holds the generator (offload/ipvs/rules.py,
which the datapath installs and explain prints) to every expectation, here; and replays every
virtual server with real servers as real traffic through the IPVS datapath in the VM lab's ipvs
guest (the endpoints become pods there: `pod_address`).

Not transcribed, with the reason: the SCTP cases of TestNodePortIPv4 (usproxy serves no SCTP: the
relay refuses it, the kernel datapaths do not install it); the IPv6 proxier tests (the VM's
topology is IPv4; the generator is the same code per family); the change-tracker tests
(TestBuildServiceMap*, Test_updateEndpointsMap: usproxy's core/, tested there); kernel handles
(TestGetNodeIPs, TestIpIsValidForSet, TestCanUseIPVSProxier: the probe; TestCleanupLeftovers:
tests/offload/ipvs); TestCleanLegacyService*, where kube-proxy deletes every virtual server not
its own outside --ipvs-exclude-cidrs: usproxy never touches another program's virtual server
(README, "The IPVS datapath"). kube-proxy's E2E tests give their Service no port (0, which the API
server refuses); here it is 80, which changes none of their expectations.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint, categorize
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName

NODE = "test-node"  # kube-proxy's testNodeName


@dataclass(frozen=True, slots=True)
class S:
    """A Service with one port."""

    name: str
    cluster_ip: str
    port: int = 80
    proto: str = "TCP"
    node_port: int = 0
    type: str = "ClusterIP"
    etp: str = "Cluster"
    itp: str = "Cluster"
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    source_ranges: tuple[str, ...] = ()
    hc_node_port: int = 0
    affinity: int = 0  # ClientIP timeout; 0: no affinity
    port_name: str = "p80"
    namespace: str = "ns1"


@dataclass(frozen=True, slots=True)
class E:
    """An endpoint of Service `service` (its slice port named as the Service's)."""

    service: str
    ip: str
    port: int = 80
    node: str | None = None
    ready: bool = True
    serving: bool = True
    terminating: bool = False


@dataclass(frozen=True, slots=True)
class Vs:
    """An expected virtual server; `reals` as "ip:port" (None: not checked by kube-proxy's test)."""

    proto: str
    addr: str
    port: int
    reals: tuple[str, ...] | None = ()
    persistent: int = 0


@dataclass(frozen=True, slots=True)
class Rule:
    jump: str
    match_set: str = ""


@dataclass(frozen=True, slots=True)
class Case:
    key: str
    test: str
    services: tuple[S, ...]
    endpoints: tuple[E, ...] = ()
    node_ips: tuple[str, ...] = ()  # the fake proxier's node addresses (NodePort virtual servers)
    servers: tuple[Vs, ...] | None = None  # the family's virtual servers, exactly (None: not checked)
    server_count: int | None = None
    servers_some: tuple[Vs, ...] = ()  # virtual servers that must be there (others may be)
    sets: dict[str, tuple[str, ...]] = field(default_factory=dict)  # set -> its entries, exactly
    chains: dict[str, tuple[Rule, ...]] = field(default_factory=dict)
    bound: tuple[str, ...] | None = None  # kube-ipvs0's addresses, exactly

    def states(self) -> dict[ServicePortName, ServicePortState]:
        """The ServicePortStates usproxy's Proxier hands the datapath (node test-node)."""
        out = {}
        for s in self.services:
            name = ServicePortName(s.namespace, s.name, s.port_name, s.proto)  # type: ignore[arg-type]
            sp = ServicePort(
                name=name, cluster_ips=(ipaddress.ip_address(s.cluster_ip),), port=s.port, target_port=80,
                node_port=s.node_port, service_type=s.type, session_affinity="ClientIP" if s.affinity else "None",  # type: ignore[arg-type]
                affinity_timeout=s.affinity or 10800, external_traffic_policy=s.etp,  # type: ignore[arg-type]
                internal_traffic_policy=s.itp,  # type: ignore[arg-type]
                external_ips=tuple(ipaddress.ip_address(a) for a in s.external_ips if ":" not in a),
                load_balancer_ips=tuple(ipaddress.ip_address(a) for a in s.lb_ips),
                source_ranges=tuple(ipaddress.ip_network(c) for c in s.source_ranges),
                health_check_node_port=s.hc_node_port if s.type == "LoadBalancer" and s.etp == "Local" else 0)
            eps = [Endpoint(ipaddress.ip_address(e.ip), e.port, e.ready, e.serving, e.terminating, e.node)
                   for e in self.endpoints if e.service == s.name]
            cat = categorize(sp, eps, NODE)
            short = cat.cluster_policy if sp.external_traffic_policy == "Local" else ()
            out[name] = ServicePortState(sp, tuple(eps), cat.cluster, cat.external, short)
        return out


def pod_address(ip: str) -> str:
    """Where a kube-proxy endpoint address lives in the VM's topology (pods are 10.244/16 there):
    10.180.x.y -> 10.244.(180+x).y, 10.0.1.y -> 10.244.201.y."""
    a, b, c, d = (int(x) for x in ip.split("."))
    if (a, b) == (10, 180):
        return f"10.244.{180 + c}.{d}"
    if (a, b, c) == (10, 0, 1):
        return f"10.244.201.{d}"
    raise ValueError(f"no pod address for {ip}")


NP = "100.101.102.103"
SVC = "KUBE-SERVICES"
LO = Rule("RETURN")  # -s 127.0.0.0/8 -j RETURN
HC = Rule("ACCEPT", "KUBE-HEALTH-CHECK-NODE-PORT")
EP1 = E("svc1", "10.180.0.1")


def _e2e(itp: str, nodes: tuple[str, str, str], reals: tuple[str, ...], loop_back: bool) -> Case:
    eps = tuple(E("svc1", f"10.0.1.{i}", node=n) for i, n in enumerate(nodes, start=1))
    return Case(f"itp-{itp.lower()}-{'local' if loop_back else 'remote'}",
                f"TestTestInternalTrafficPolicyE2E/{itp}, {'non-zero' if loop_back else 'zero'} local endpoints",
                (S("svc1", "172.20.1.1", port_name="", itp=itp),), eps,
                servers=(Vs("TCP", "172.20.1.1", 80, reals),),
                sets={"KUBE-LOOP-BACK": ("10.0.1.1,tcp:80,10.0.1.1",) if loop_back else ()})


def _terminating(etp: str, conditions: tuple[tuple[bool, bool, bool, str], ...], cluster: tuple[str, ...],
                 external: tuple[str, ...], loop_back: tuple[str, ...], test: str) -> Case:
    eps = tuple(E("svc1", f"10.0.1.{i}", node=n, ready=r, serving=s, terminating=t)
                for i, (r, s, t, n) in enumerate(conditions, start=1))
    return Case(test.split("_", 1)[1].lower(), test,
                (S("svc1", "172.20.1.1", port_name="", type="NodePort", etp=etp, external_ips=("1.2.3.4",)),), eps,
                servers=(Vs("TCP", "172.20.1.1", 80, cluster), Vs("TCP", "1.2.3.4", 80, external)),
                sets={"KUBE-LOOP-BACK": tuple(f"{ip},tcp:80,{ip}" for ip in loop_back)})


_T, _F = True, False
CASES: tuple[Case, ...] = (
    Case("nodeport-tcp", "TestNodePortIPv4/1 service with node port, has 2 endpoints",
         (S("svc1", "10.20.30.41", node_port=3001, type="NodePort"),), (EP1,), (NP,),
         servers=(Vs("TCP", "10.20.30.41", 80, ("10.180.0.1:80",)), Vs("TCP", NP, 3001, ("10.180.0.1:80",)))),
    Case("nodeport-udp", "TestNodePortIPv4/1 UDP service with node port, has endpoints",
         (S("svc1", "10.20.30.41", proto="UDP", node_port=3001, type="NodePort"),), (EP1,), (NP,),
         servers=(Vs("UDP", "10.20.30.41", 80, ("10.180.0.1:80",)), Vs("UDP", NP, 3001, ("10.180.0.1:80",))),
         sets={"KUBE-NODE-PORT-UDP": ("3001",)},
         chains={"KUBE-NODE-PORT": (Rule("KUBE-MARK-MASQ", "KUBE-NODE-PORT-UDP"), HC),
                 SVC: (LO, Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"), Rule("KUBE-NODE-PORT"),
                       Rule("ACCEPT", "KUBE-CLUSTER-IP"))}),
    Case("nodeport-no-endpoints", "TestNodePortIPv4/service has node port but no endpoints",
         (S("svc1", "10.20.30.41", node_port=3001, type="NodePort"),), (), (NP,),
         servers=(Vs("TCP", "10.20.30.41", 80), Vs("TCP", NP, 3001))),
    Case("clusterip", "TestIPv4Proxier/2 services with Cluster IP, each with endpoints",
         (S("svc1", "10.20.30.41"),), (EP1,), servers=(Vs("TCP", "10.20.30.41", 80, ("10.180.0.1:80",)),)),
    Case("clusterip-no-endpoints", "TestIPv4Proxier/cluster IP service with no endpoints",
         (S("svc1", "10.20.30.41"),), (), servers=(Vs("TCP", "10.20.30.41", 80),)),
    Case("external-ip-no-endpoint", "TestExternalIPsNoEndpoint",
         (S("svc1", "10.20.30.41", external_ips=("50.60.70.81",)),), (), server_count=2,
         servers_some=(Vs("TCP", "50.60.70.81", 80),)),
    Case("external-ips", "TestExternalIPs",
         (S("svc1", "10.20.30.41", external_ips=("50.60.70.81", "2012::51", "127.0.0.1")),),
         (E("svc1", "10.180.0.1"),), server_count=3,
         servers_some=(Vs("TCP", "50.60.70.81", 80, ("10.180.0.1:80",)),)),
    Case("external-ips-local", "TestOnlyLocalExternalIPs",
         (S("svc1", "10.20.30.41", type="NodePort", etp="Local", external_ips=("50.60.70.81", "2012::51", "127.0.0.1")),),
         (E("svc1", "10.180.0.1", node=NODE), E("svc1", "10.180.1.1", node="other-node")), server_count=3,
         servers_some=(Vs("TCP", "50.60.70.81", 80, ("10.180.0.1:80",)),)),
    Case("load-balancer", "TestLoadBalancer",
         (S("svc1", "10.20.30.41", node_port=3001, type="LoadBalancer", lb_ips=("1.2.3.4",)),), (EP1,), server_count=2,
         sets={"KUBE-LOAD-BALANCER": ("1.2.3.4,tcp:80",)},
         chains={SVC: (LO, Rule("KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER"), Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"),
                       Rule("KUBE-NODE-PORT"), Rule("ACCEPT", "KUBE-CLUSTER-IP"), Rule("ACCEPT", "KUBE-LOAD-BALANCER")),
                 "KUBE-LOAD-BALANCER": (Rule("KUBE-MARK-MASQ"),)}),
    Case("nodeport-local", "TestOnlyLocalNodePorts",
         (S("svc1", "10.20.30.41", node_port=3001, type="NodePort", etp="Local"),),
         (E("svc1", "10.180.0.1", node=NODE), E("svc1", "10.180.1.1", node="other-node")), (NP,), server_count=2,
         servers_some=(Vs("TCP", NP, 3001, ("10.180.0.1:80",)),),
         sets={"KUBE-NODE-PORT-TCP": ("3001",), "KUBE-NODE-PORT-LOCAL-TCP": ("3001",)},
         chains={SVC: (LO, Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"), Rule("KUBE-NODE-PORT"),
                       Rule("ACCEPT", "KUBE-CLUSTER-IP")),
                 "KUBE-NODE-PORT": (Rule("RETURN", "KUBE-NODE-PORT-LOCAL-TCP"),
                                    Rule("KUBE-MARK-MASQ", "KUBE-NODE-PORT-TCP"), HC)}),
    Case("health-check-node-port", "TestHealthCheckNodePort",
         (S("valid-svc1", "10.20.30.41", node_port=3000, type="LoadBalancer", etp="Local", hc_node_port=30000),
          S("valid-svc2", "10.20.30.42", node_port=3000, type="LoadBalancer", etp="Local", hc_node_port=30001),
          S("invalid-svc3", "10.20.30.43", node_port=3000, type="LoadBalancer", etp="Cluster", hc_node_port=30002)),
         (), (NP,), sets={"KUBE-HEALTH-CHECK-NODE-PORT": ("30000", "30001")},
         chains={"KUBE-NODE-PORT": (Rule("RETURN", "KUBE-NODE-PORT-LOCAL-TCP"),
                                    Rule("KUBE-MARK-MASQ", "KUBE-NODE-PORT-TCP"), HC)}),
    Case("source-ranges", "TestLoadBalancerSourceRanges",
         (S("svc1", "10.20.30.41", type="LoadBalancer", lb_ips=("1.2.3.4",), source_ranges=("10.0.0.0/8",)),),
         (EP1,), server_count=2, servers_some=(Vs("TCP", "1.2.3.4", 80, ("10.180.0.1:80",)),),
         sets={"KUBE-LOAD-BALANCER": ("1.2.3.4,tcp:80",), "KUBE-LOAD-BALANCER-FW": ("1.2.3.4,tcp:80",),
               "KUBE-LOAD-BALANCER-SOURCE-CIDR": ("1.2.3.4,tcp:80,10.0.0.0/8",)},
         chains={SVC: (LO, Rule("KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER"), Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"),
                       Rule("KUBE-NODE-PORT"), Rule("ACCEPT", "KUBE-CLUSTER-IP"), Rule("ACCEPT", "KUBE-LOAD-BALANCER")),
                 "KUBE-PROXY-FIREWALL": (Rule("KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOAD-BALANCER-FW"),),
                 "KUBE-SOURCE-RANGES-FIREWALL": (Rule("RETURN", "KUBE-LOAD-BALANCER-SOURCE-CIDR"), Rule("DROP"))}),
    Case("accept-ipvs-traffic", "TestAcceptIPVSTraffic",
         (S("svc1", "10.20.30.40", node_port=80, external_ips=("5.6.7.8",)),
          S("svc2", "10.20.30.41", node_port=80, type="LoadBalancer", lb_ips=("1.2.3.4",)),
          S("svc3", "10.20.30.42", node_port=80, type="NodePort")), (),
         chains={SVC: (LO, Rule("KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER"), Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"),
                       Rule("KUBE-MARK-MASQ", "KUBE-EXTERNAL-IP"), Rule("ACCEPT", "KUBE-EXTERNAL-IP"),
                       Rule("ACCEPT", "KUBE-EXTERNAL-IP"), Rule("KUBE-NODE-PORT"), Rule("ACCEPT", "KUBE-CLUSTER-IP"),
                       Rule("ACCEPT", "KUBE-LOAD-BALANCER"))}),
    Case("load-balancer-local", "TestOnlyLocalLoadBalancing",
         (S("svc1", "10.20.30.41", node_port=3001, type="LoadBalancer", etp="Local", lb_ips=("1.2.3.4",)),),
         (E("svc1", "10.180.0.1", node=NODE), E("svc1", "10.180.1.1", node="other-node")), server_count=2,
         servers_some=(Vs("TCP", "1.2.3.4", 80, ("10.180.0.1:80",)),),
         sets={"KUBE-LOAD-BALANCER": ("1.2.3.4,tcp:80",), "KUBE-LOAD-BALANCER-LOCAL": ("1.2.3.4,tcp:80",)},
         chains={SVC: (LO, Rule("KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER"), Rule("KUBE-MARK-MASQ", "KUBE-CLUSTER-IP"),
                       Rule("KUBE-NODE-PORT"), Rule("ACCEPT", "KUBE-CLUSTER-IP"), Rule("ACCEPT", "KUBE-LOAD-BALANCER")),
                 "KUBE-LOAD-BALANCER": (Rule("RETURN", "KUBE-LOAD-BALANCER-LOCAL"), Rule("KUBE-MARK-MASQ"))}),
    Case("session-affinity", "TestSessionAffinity",
         (S("svc1", "10.20.30.41", node_port=3001, type="NodePort", external_ips=("50.60.70.81",), affinity=10800),),
         (), (NP,), servers=(Vs("TCP", "10.20.30.41", 80, (), 10800), Vs("TCP", "50.60.70.81", 80, (), 10800),
                             Vs("TCP", NP, 3001, (), 10800))),
    Case("multi-port-bind-addr", "TestMultiPortServiceBindAddr",
         (S("svc1", "172.16.55.4", port=1234, port_name="port1"), S("svc1", "172.16.55.4", port=1235, port_name="port2"),
          S("svc1", "172.16.55.4", port=1236, proto="UDP", port_name="port3")), (), bound=("172.16.55.4",)),
    Case("endpoint-slice-e2e", "TestEndpointSliceE2E",
         (S("svc1", "172.20.1.1", port_name=""),),
         (E("svc1", "10.0.1.1", node=NODE), E("svc1", "10.0.1.2", node="node2"), E("svc1", "10.0.1.3", node="node3"),
          E("svc1", "10.0.1.4", node="node3", ready=False, serving=False)),
         servers=(Vs("TCP", "172.20.1.1", 80, ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80")),),
         sets={"KUBE-LOOP-BACK": ("10.0.1.1,tcp:80,10.0.1.1",)}),
    _e2e("Cluster", (NODE, "node1", "node2"), ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"), True),
    _e2e("Cluster", ("node0", "node1", "node2"), ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"), False),
    _e2e("Local", (NODE, "node1", "node2"), ("10.0.1.1:80",), True),
    _e2e("Local", ("node0", "node1", "node2"), (), False),
    _terminating("Cluster", ((_T, _T, _F, NODE), (_T, _T, _F, NODE), (_F, _T, _T, NODE), (_F, _F, _T, NODE),
                             (_T, _T, _F, "another-node")),
                 ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"), ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"),
                 ("10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"), "Test_EndpointSliceReadyAndTerminatingCluster"),
    _terminating("Local", ((_T, _T, _F, NODE), (_T, _T, _F, NODE), (_F, _T, _T, NODE), (_F, _F, _T, NODE),
                           (_T, _T, _F, "another-node")),
                 ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"), ("10.0.1.1:80", "10.0.1.2:80"),
                 ("10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"), "Test_EndpointSliceReadyAndTerminatingLocal"),
    _terminating("Cluster", ((_F, _T, _T, NODE), (_F, _T, _T, NODE), (_F, _F, _T, NODE), (_F, _T, _T, "another-node"),
                             (_F, _F, _F, "another-node")),
                 ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.4:80"), ("10.0.1.1:80", "10.0.1.2:80", "10.0.1.4:80"),
                 ("10.0.1.1", "10.0.1.2", "10.0.1.3"), "Test_EndpointSliceOnlyReadyAndTerminatingCluster"),
    _terminating("Local", ((_F, _T, _T, NODE), (_F, _T, _T, NODE), (_F, _F, _T, NODE), (_F, _T, _T, "another-node"),
                           (_T, _T, _F, "another-node")),
                 ("10.0.1.5:80",), ("10.0.1.1:80", "10.0.1.2:80"),
                 ("10.0.1.1", "10.0.1.2", "10.0.1.3"), "Test_EndpointSliceOnlyReadyAndTerminatingLocal"),
)
