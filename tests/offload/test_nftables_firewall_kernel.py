"""loadBalancerSourceRanges in the real kernel (NftablesDatapath in a throwaway node namespace, no
agent): a client inside the ranges reaches the pod through the LB IP, one outside gets no answer
at all (DROP: its connection times out, it is not refused), and the NodePort of the same Service
still serves the blocked client, as kube-proxy's TestLoadBalancer ("nodePort bypasses
LoadBalancerSourceRanges"). Clients use documentation addresses on a namespace of their own."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import pytest

from usproxy.datapath import ServicePortState
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.types import ServicePortName

from tests.netns import Topology, nsexec
from tests.offload.harness import Pods, tcp_name, udp_socket, wait_listening
from tests.offload.helpers import ep, spn, state

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
