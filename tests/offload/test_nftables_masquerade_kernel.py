"""Masquerade and the externalTrafficPolicy Local short-circuit of the nftables datapath as real
traffic in a throwaway node namespace: endpoints (idsrv) answer with their name and the client
address they saw. As kube-proxy's TestInternalExternalMasquerade (pkg/proxy/nftables/proxier_test.go):
with a local-traffic detector, ClusterIP traffic from outside the pod network is masqueraded
and pod traffic is not; without one nothing is; with masqueradeAll everything is. eTP Local:
pods reach every endpoint with their own address, external clients only the local endpoint, and
get no answer at all (DROP, not a refusal) when there is none."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.node import NodeFacts
from usproxy.offload.nftables.datapath import NftablesDatapath

from tests.netns import Topology, nsexec
from tests.offload.harness import Pods, tcp_name, tcp_peer_name, wait_listening
from tests.offload.helpers import ep, spn, state

pytestmark = pytest.mark.netns

VIP, NODE_IP, NP = "10.96.10.10", "192.0.2.10", 30080
WEB = spn("web", "http")
POD_NET = local_detector("ClusterCIDR", cluster_cidrs=("10.244.1.0/24",))  # be-a and the pod client
POD, EXT = "10.244.1.50", "10.244.9.10"  # a pod client, and a client outside the pod network


@pytest.fixture
def clients(topology: Topology, pods: Pods) -> Iterator[dict[str, str]]:
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/16", "dev", "usbr0")
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    out = {"pod": topology.add_host("pod", POD), "ext": topology.add_host("ext", EXT)}
    wait_listening(out["ext"], "10.244.1.5", 8080)
    wait_listening(out["ext"], "10.244.2.5", 8080)
    yield out


def datapath(topology: Topology, detector: LocalDetector = LocalDetector(), masquerade_all: bool = False) -> NftablesDatapath:
    return NftablesDatapath(netns=topology.node, node=NodeFacts("node", detector=detector, masquerade_all=masquerade_all))


def web(*eps: tuple[str, str], **kw: Any) -> ServicePortState:
    return state(WEB, VIP, 80, [ep(ip, node_name=node) for ip, node in eps], node_port=NP, service_type="NodePort", **kw)


def peers(ns: str, addr: str, port: int, n: int = 30) -> set[tuple[str, str]]:
    """(endpoint name, client address it saw) over `n` connections."""
    return {tcp_peer_name(ns, addr, port) for _ in range(n)}


@pytest.mark.parametrize("config,detector,masquerade_all,pod_masq,ext_masq", [
    ("base", POD_NET, False, False, True),
    ("no LocalTrafficDetector", LocalDetector(), False, False, False),
    ("masqueradeAll", POD_NET, True, True, True),
    ("masqueradeAll, no LocalTrafficDetector", LocalDetector(), True, True, True),
])
async def test_cluster_ip_masquerade_per_configuration(topology: Topology, clients: dict[str, str], config: str,
                                                       detector: LocalDetector, masquerade_all: bool,
                                                       pod_masq: bool, ext_masq: bool) -> None:
    dp = datapath(topology, detector, masquerade_all)
    try:
        await dp.apply({WEB: web(("10.244.1.5", "node"))})
        (pod_seen,) = {peer for _, peer in peers(clients["pod"], VIP, 80, 5)}
        (ext_seen,) = {peer for _, peer in peers(clients["ext"], VIP, 80, 5)}
        assert (pod_seen != POD, ext_seen != EXT) == (pod_masq, ext_masq), config
    finally:
        await dp.cleanup()
        dp.close()


async def test_local_policy_short_circuits_pods_and_limits_external_clients(topology: Topology,
                                                                           clients: dict[str, str]) -> None:
    dp = datapath(topology, POD_NET)
    try:
        await dp.apply({WEB: web(("10.244.1.5", "node"), ("10.244.2.5", "other"),
                                 external_traffic_policy="Local")})
        # pod to NodePort: every endpoint (the remote one too), the pod's own address kept
        assert peers(clients["pod"], NODE_IP, NP) == {("be-a", POD), ("be-b", POD)}
        # external to NodePort: the local endpoint only, the client's address kept
        assert peers(clients["ext"], NODE_IP, NP, 10) == {("be-a", EXT)}
        # the node itself: every endpoint, masqueraded (its NodePort address is a local one)
        with_node = peers(topology.node, NODE_IP, NP)
        assert {name for name, _ in with_node} == {"be-a", "be-b"}
    finally:
        await dp.cleanup()
        dp.close()


async def test_local_policy_without_local_endpoint_drops_external_but_serves_pods(topology: Topology,
                                                                                 clients: dict[str, str]) -> None:
    dp = datapath(topology, POD_NET)
    try:
        await dp.apply({WEB: web(("10.244.2.5", "other"), external_traffic_policy="Local")})
        with pytest.raises(TimeoutError):  # dropped: no refusal, no answer
            tcp_name(clients["ext"], NODE_IP, NP, timeout=1.5)
        assert peers(clients["pod"], NODE_IP, NP, 5) == {("be-b", POD)}
        # internalTrafficPolicy Local with the endpoint elsewhere: ClusterIP traffic dropped too
        await dp.apply({WEB: web(("10.244.2.5", "other"), internal_traffic_policy="Local")})
        with pytest.raises(TimeoutError):
            tcp_name(clients["pod"], VIP, 80, timeout=1.5)
        await dp.apply({WEB: web()})  # no endpoint anywhere: refused at once, as before
        with pytest.raises(ConnectionRefusedError):
            tcp_name(clients["pod"], VIP, 80, timeout=1.5)
    finally:
        await dp.cleanup()
        dp.close()
