"""Three nodes, one agent each, the same Services from one (fake) API server (issue 13 item 10).

An external client on 203.0.113.10 reaches the nodes through a router; pods answer with their name
and the peer they saw. As kube-proxy on a real cluster (nftables mode, every node the same):
- a NodePort (externalTrafficPolicy Cluster) answers on every node, even one without endpoints,
  and the pod sees the node's address (masqueraded: the reply must come back through that node);
- externalTrafficPolicy Local: the node with the endpoint answers and the pod sees the client's own
  address; a node without local endpoints drops the connection (kube-proxy's TestOnlyLocalNodePorts)
  and its health check NodePort says 503 where the endpoint's node says 200, which is how a cloud
  load balancer learns to send only to the first;
- a pod on a node without local endpoints reaches the eTP=Local NodePort through its own node
  (kube-proxy's short-circuit: pod traffic uses every endpoint);
- an agent restarting on one node never interrupts the others, and its own offloaded NodePorts keep
  answering while it is down (the kernel keeps the rules; the agent reads them back).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster import EXT, LAN, Cluster, node_ip
from tests.cluster.workload import ask, service, slice_of
from tests.netns import inside
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

pytestmark = pytest.mark.netns

AGENT_FLAGS = ("--offload", "nftables", "--offload-after", "0.5", "--min-sync-period", "200ms",
               "--cluster-cidr", "10.244.0.0/16")  # pods are told from outside clients by their network
WEB_NP, LOCAL_NP, HC_PORT = 30080, 30081, 32000


def health(ns: str, addr: str, port: int) -> tuple[int, dict[str, Any]]:
    with inside(ns):
        try:
            with urllib.request.urlopen(f"http://{addr}:{port}/", timeout=2) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


async def offloaded(c: Cluster, nodes: range, timeout: float = 15.0) -> None:
    """Wait until every ServicePort on `nodes` is carried by nftables."""
    deadline = time.monotonic() + timeout
    for i in nodes:
        while True:
            rows = await asyncio.to_thread(c.admin, i, "/services")
            if rows and all(r.get("datapath") == "nftables" for r in rows):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"n{i} did not offload: {rows}\n{c.log(i)}")
            await asyncio.sleep(0.1)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    try:
        c.build()
        c.add_pod(1, "web-a", "10.244.1.10")
        c.add_pod(2, "web-b", "10.244.2.10")
        c.add_pod(1, "local-a", "10.244.1.11")
        c.add_pod(2, "client-2", "10.244.2.20", serve=False)
        with inside(c.ns("lan")):
            await api.start()
        api.apply("services", service("web", "10.96.20.10", WEB_NP, "Cluster"))
        api.apply("endpointslices", slice_of("web", [("10.244.1.10", 1), ("10.244.2.10", 2)]))
        api.apply("services", service("local", "10.96.20.11", LOCAL_NP, "Local", type="LoadBalancer",
                                      healthCheckNodePort=HC_PORT))
        api.apply("endpointslices", slice_of("local", [("10.244.1.11", 1)]))
        kc = tmp_path / "kubeconfig"
        kc.write_text(kubeconfig_text(api.url))
        for i in (1, 2, 3):
            await asyncio.to_thread(c.start_agent, i, kc, *AGENT_FLAGS)
        await offloaded(c, range(1, 4))
        yield c
    finally:
        await asyncio.to_thread(c.close)
        await api.stop()


async def test_nodeport_answers_on_every_node_and_is_masqueraded(cluster: Cluster) -> None:
    ext = cluster.ns("ext")
    for i in (1, 2, 3):
        seen = {await asyncio.to_thread(ask, ext, node_ip(i), WEB_NP) for _ in range(6)}
        names = {name for name, _ in seen}
        assert names <= {"web-a", "web-b"} and names, (i, seen)
        assert all(peer != EXT for _, peer in seen), (i, seen)  # eTP=Cluster: source NAT


async def test_local_policy_keeps_the_client_address_and_drops_where_no_endpoint(cluster: Cluster) -> None:
    ext = cluster.ns("ext")
    assert await asyncio.to_thread(ask, ext, node_ip(1), LOCAL_NP) == ("local-a", EXT)
    for i in (2, 3):  # no local endpoint: dropped (no answer at all), as kube-proxy
        assert await asyncio.to_thread(ask, ext, node_ip(i), LOCAL_NP, 1.0) == ("timeout", "")


async def test_health_check_node_port_says_where_the_endpoints_are(cluster: Cluster) -> None:
    ext = cluster.ns("ext")
    code, body = await asyncio.to_thread(health, ext, node_ip(1), HC_PORT)
    assert code == 200 and body["localEndpoints"] == 1, body
    assert body["service"] == {"namespace": "default", "name": "local"}
    for i in (2, 3):
        code, body = await asyncio.to_thread(health, ext, node_ip(i), HC_PORT)
        assert code == 503 and body["localEndpoints"] == 0, (i, body)


async def test_pod_traffic_to_a_local_policy_nodeport_uses_every_endpoint(cluster: Cluster) -> None:
    # client-2 is on n2, which has no endpoint of `local`: its own node sends it to n1's pod
    name, peer = await asyncio.to_thread(ask, cluster.ns("client-2"), node_ip(2), LOCAL_NP)
    assert name == "local-a", (name, peer)


async def test_an_agent_restart_interrupts_no_node(cluster: Cluster) -> None:
    ext = cluster.ns("ext")
    kc = cluster.tmp / "kubeconfig"
    assert cluster.stop_agent(1) == 0
    for _ in range(5):  # n1's agent is down: every node, n1 included, still answers
        for i in (1, 2, 3):
            name, _ = await asyncio.to_thread(ask, ext, node_ip(i), WEB_NP)
            assert name in ("web-a", "web-b"), (i, name)
        assert (await asyncio.to_thread(ask, ext, node_ip(1), LOCAL_NP))[0] == "local-a"
    await asyncio.to_thread(cluster.start_agent, 1, kc, *AGENT_FLAGS)
    await offloaded(cluster, range(1, 2))
    for i in (1, 2, 3):
        assert (await asyncio.to_thread(ask, ext, node_ip(i), WEB_NP))[0] in ("web-a", "web-b")
    assert await asyncio.to_thread(ask, ext, node_ip(1), LOCAL_NP) == ("local-a", EXT)
