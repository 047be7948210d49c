"""loadBalancerSourceRanges in the real kernel (NftablesDatapath in a throwaway node namespace, no
agent): a client inside the ranges reaches the pod through the LB IP, one outside gets no answer
at all (DROP: its connection times out, it is not refused), and the NodePort of the same Service
still serves the blocked client, as kube-proxy's TestLoadBalancer ("nodePort bypasses
LoadBalancerSourceRanges"). Clients use documentation addresses on a namespace of their own."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.model.types import ServicePortName

from tests.netns import Topology, nsexec
from tests.offload.agent import placement, wait_for
from tests.offload.harness import Pods, tcp_name, udp_socket, wait_listening
from tests.offload.helpers import ep, spn, state
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

LB_IP, NODE_IP = "198.51.100.1", "192.0.2.10"
ALLOWED, BLOCKED = "203.0.113.2", "203.0.113.130"
WEB, DNS = spn("web", "http"), spn("dns", "dns", "UDP")


def lb(name: ServicePortName, vip: str, port: int, node_port: int,
       ranges: tuple[str, ...] = ("203.0.113.0/25",)) -> ServicePortState:
    return state(name, vip, port, [ep("10.244.1.5")], node_port=node_port,
                 service_type="LoadBalancer", load_balancer_ips=(ipaddress.ip_address(LB_IP),),
                 source_ranges=tuple(ipaddress.ip_network(r) for r in ranges))


@pytest.fixture
def dp(topology: Topology) -> Iterator[NftablesDatapath]:
    d = NftablesDatapath(netns=topology.node)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def client(topology: Topology, pods: Pods) -> str:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("ext", "10.244.9.30", ALLOWED, BLOCKED)
    nsexec(topology.node, "ip", "route", "add", "203.0.113.0/24", "via", "10.244.9.30")
    wait_listening(cli, "10.244.1.5", 8080)
    return cli


def connect_outcome(ns: str, addr: str, port: int, src: str) -> str:
    try:
        return tcp_name(ns, addr, port, timeout=1.5, src=src)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"


async def test_tcp_outside_the_ranges_is_dropped_at_the_lb_ip_not_at_the_nodeport(
        client: str, dp: NftablesDatapath) -> None:
    await dp.apply({WEB: lb(WEB, "10.96.10.10", 80, 30080)})
    assert connect_outcome(client, LB_IP, 80, ALLOWED) == "be-a"
    assert connect_outcome(client, LB_IP, 80, BLOCKED) == "timeout"  # DROP: no reset, no answer
    assert connect_outcome(client, NODE_IP, 30080, BLOCKED) == "be-a"  # the NodePort is not filtered
    assert connect_outcome(client, "10.96.10.10", 80, BLOCKED) == "be-a"  # nor the ClusterIP
    await dp.apply({WEB: lb(WEB, "10.96.10.10", 80, 30080, ranges=())})
    assert connect_outcome(client, LB_IP, 80, BLOCKED) == "be-a"  # ranges removed: open again


async def test_udp_outside_the_ranges_gets_no_answer(client: str, dp: NftablesDatapath) -> None:
    await dp.apply({DNS: lb(DNS, "10.96.10.11", 53, 30053)})
    assert udp_answer(client, LB_IP, 53, ALLOWED).startswith(b"be-a|")
    assert udp_answer(client, LB_IP, 53, BLOCKED) == b""
    assert udp_answer(client, NODE_IP, 30053, BLOCKED).startswith(b"be-a|")


def udp_answer(ns: str, addr: str, port: int, src: str) -> bytes:
    s = udp_socket(ns, (src, 0))
    s.settimeout(1.0)
    try:
        s.sendto(b"q", (addr, port))
        return s.recv(512)
    except socket.timeout:
        return b""
    finally:
        s.close()


def test_agent_offloads_the_firewall_and_the_node_reaches_its_lb_ip_when_in_range(
        topology: Topology, tmp_path: Path, client: str, agent_factory: Callable[[Manifests], AgentProc]) -> None:
    """The agent in nftables mode: the relay holds the LB IP on its interface, so the node's own
    connection to it leaves with the LB IP as source; a range holding a node address (192.0.2.10)
    allows that source too, as kube-proxy's allowFromNode ("same node to LB, SNATted to LB")."""
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080}]
    web = svc("web", "10.96.10.10", ports, type="LoadBalancer",
              loadBalancerSourceRanges=["203.0.113.0/25", "192.0.2.0/24"])
    web["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    m = Manifests(tmp_path / "m")
    m.write(web, slice_("web", [{"ip": "10.244.1.5", "ready": True}], [{"name": "http", "port": 8080, "protocol": "TCP"}]))
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
    assert f"{LB_IP} . tcp . 80" in nsexec(topology.node, "nft", "list", "map", "ip", "usproxy", "firewall-ips").stdout
    assert connect_outcome(client, LB_IP, 80, ALLOWED) == "be-a"
    assert connect_outcome(client, LB_IP, 80, BLOCKED) == "timeout"
    assert connect_outcome(client, NODE_IP, 30080, BLOCKED) == "be-a"
    assert tcp_name(topology.node, LB_IP, 80, timeout=1.5) == "be-a"  # source: the LB IP itself


@pytest.mark.parametrize("ranges", [("203.0.113.0/25",), ("203.0.113.0/25", "192.0.2.0/24")])
async def test_the_kernels_listing_reads_back_to_the_same_firewall(topology: Topology, ranges: tuple[str, ...]) -> None:
    """nft lists a one-element set, prefixes and host addresses in its own JSON forms: read back
    after a restart adopts exactly what was written, so the next sync changes nothing."""
    node = [ipaddress.ip_address(NODE_IP)]
    dp = NftablesDatapath(netns=topology.node, node_ips=lambda: node)
    again = NftablesDatapath(netns=topology.node, node_ips=lambda: node)
    try:
        await dp.apply({WEB: lb(WEB, "10.96.10.10", 80, 30080, ranges)})
        # the second case allows the LB IP as a source (a range holds the node's address)
        assert (LB_IP in dp.tables[4].rules[WEB].fw_sources) == ("192.0.2.0/24" in ranges)
        await again.read_back()
        assert again.tables[4].rules == dp.tables[4].rules
    finally:
        dp.close()
        again.close()
