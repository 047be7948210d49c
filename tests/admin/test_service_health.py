"""Service health checks (healthCheckNodePort) as kube-proxy pkg/proxy/healthcheck: the answer
(status, headers, tab-indented JSON body), SyncServices/SyncEndpoints semantics over real HTTP on
loopback (open, keep, re-open on a port change, close), a port that cannot be bound reported with
its errno and retried while other Services answer (and shown in the agent's /services until the
periodic sync takes the freed port), the Proxier's counts (local ready endpoints
by distinct address, only after a successful sync), and the model field's parsing."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.app.helpers import closed
from tests.core.helpers import eps, service
from usproxy.admin.service_health import ServiceHealthServer, reply
from usproxy.app.agent import Agent
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import FakeDatapath
from usproxy.model.endpoint import Endpoint
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.model.manifest import objects_from
from usproxy.model.node import NodeFacts
from usproxy.core.proxier import Proxier
from usproxy.model.types import NamespacedName, ServicePortName
from usproxy.util.rows import ServiceRow

AB, CD = NamespacedName("a", "b"), NamespacedName("c", "d")
LOOPBACK = NodeFacts("node1", (ipaddress.ip_network("127.0.0.1/32"),))


def test_reply_is_kube_proxys_body_headers_and_status() -> None:
    r = reply(AB, 18, True)
    assert r.status == 200
    assert r.body == ('{\n\t"service": {\n\t\t"namespace": "a",\n\t\t"name": "b"\n\t},\n'
                      '\t"localEndpoints": 18,\n\t"serviceProxyHealthy": true\n}')
    assert dict(r.headers) == {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff",
                               "X-Load-Balancing-Endpoint-Weight": "18"}
    assert json.loads(r.body) == {"service": {"namespace": "a", "name": "b"}, "localEndpoints": 18,
                                  "serviceProxyHealthy": True}


@pytest.mark.parametrize("count,healthy,status", [(0, True, 503), (7, False, 503), (0, False, 503), (1, True, 200)])
def test_reply_is_503_without_local_endpoints_or_when_the_proxy_is_unhealthy(
        count: int, healthy: bool, status: int) -> None:
    r = reply(AB, count, healthy)
    assert r.status == status
    assert json.loads(r.body)["localEndpoints"] == count and json.loads(r.body)["serviceProxyHealthy"] is healthy
    assert dict(r.headers)["X-Load-Balancing-Endpoint-Weight"] == str(count)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def probe(port: int, path: str = "/healthz") -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status, dict(r.headers), json.loads(await r.text())


async def refused(port: int) -> bool:
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    await shut(w)
    return False


async def shut(w: asyncio.StreamWriter) -> None:
    w.close()
    try:
        await w.wait_closed()
    except ConnectionError:
        pass


async def test_sync_services_and_endpoints_over_http() -> None:
    healthy = [True]
    hcs = ServiceHealthServer(LOOPBACK, lambda: healthy[0])
    p1, p2, p3 = free_port(), free_port(), free_port()
    try:
        await hcs.sync({AB: p1}, {})
        assert hcs.listening(AB) == [("127.0.0.1", p1)]
        status, headers, body = await probe(p1, "/any/path")
        assert (status, body["localEndpoints"], body["service"]) == (503, 0, {"namespace": "a", "name": "b"})
        assert headers["X-Content-Type-Options"] == "nosniff"
        await hcs.sync({AB: p1, CD: p2}, {AB: 3, NamespacedName("x", "unknown"): 9})
        assert (await probe(p1))[0] == 200 and (await probe(p1))[2]["localEndpoints"] == 3
        assert (await probe(p2))[0] == 503
        healthy[0] = False
        status, _, body = await probe(p1)
        assert status == 503 and body == {"service": {"namespace": "a", "name": "b"}, "localEndpoints": 3,
                                          "serviceProxyHealthy": False}
        healthy[0] = True
        await hcs.sync({AB: p3, CD: p2}, {CD: 1})  # a/b moves to another port, c/d is kept
        assert await refused(p1)
        assert (await probe(p3))[2]["localEndpoints"] == 0 and (await probe(p2))[0] == 200
        await hcs.sync({}, {})
        assert await refused(p3) and await refused(p2) and hcs.checks == {}
    finally:
        await hcs.close()


async def test_port_in_use_is_reported_with_errno_other_services_unaffected_and_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    hcs = ServiceHealthServer(LOOPBACK, lambda: True)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy, other = int(taken.getsockname()[1]), free_port()
    try:
        await hcs.sync({AB: busy, CD: other}, {AB: 1, CD: 1})
        assert f"[Errno {errno.EADDRINUSE}]" in str(hcs.error_of(AB)) and hcs.error_of(CD) is None
        assert f"port {busy}" in str(hcs.errors()[AB]) and hcs.listening(AB) == []
        assert (await probe(other))[0] == 200
        await hcs.sync({AB: busy, CD: other}, {AB: 1, CD: 1})  # still taken: logged once only
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "a/b" in errors[0] and "Address already in use" in errors[0]
        taken.close()
        await hcs.sync({AB: busy, CD: other}, {AB: 1, CD: 1})  # the next sync retries
        assert hcs.error_of(AB) is None and (await probe(busy))[0] == 200
    finally:
        taken.close()
        await hcs.close()


async def test_no_node_address_in_nodeport_cidrs_is_an_error_not_a_wildcard() -> None:
    hcs = ServiceHealthServer(NodeFacts("n", (ipaddress.ip_network("198.18.255.0/24"),)), lambda: True)
    try:
        await hcs.sync({AB: free_port()}, {})  # a benchmarking range no host holds
        assert "no address of this node is in --nodeport-addresses 198.18.255.0/24" in str(hcs.error_of(AB))
    finally:
        await hcs.close()


async def test_connections_over_the_service_share_make_room_for_a_probe() -> None:
    """A Service's share full of idle connections (a hog, perhaps behind the load balancer's own
    address): a probe is still answered at once, the connection idle the longest closed to make
    room, the hog's others kept; another Service still answers."""
    hcs = ServiceHealthServer(LOOPBACK, lambda: True, max_connections=8)  # 2 per Service
    port = free_port()
    try:
        await hcs.sync({AB: port}, {AB: 1})
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, _, body = await asyncio.wait_for(probe(port), 1.0)
        assert status == 200 and body["localEndpoints"] == 1
        assert await closed(held[0][0])  # idle the longest: closed to make room
        assert not held[1][0].at_eof()
        await hcs.sync({AB: port, CD: free_port()}, {AB: 1})
        assert (await probe(hcs.listening(CD)[0][1]))[0] == 503  # another Service still answers
        for _, w in held:
            await shut(w)
    finally:
        await hcs.close()


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[NamespacedName, int], dict[NamespacedName, int]]] = []

    async def sync(self, ports: Any, counts: Any) -> None:
        self.calls.append((dict(ports), dict(counts)))


def two_port_slice(node: str) -> EndpointSlice:
    """default/lb on ports http and https: 10.244.1.1 (this node) serves both, 10.244.1.2 (this
    node, not ready), 10.244.2.2 (another node)."""
    out = {}
    for port in ("http", "https"):
        out[ServicePortName("default", "lb", port, "TCP")] = (
            Endpoint(ipaddress.ip_address("10.244.1.1"), 8080, node_name=node),
            Endpoint(ipaddress.ip_address("10.244.1.2"), 8080, ready=False, node_name=node),
            Endpoint(ipaddress.ip_address("10.244.2.2"), 8080, node_name="node2"))
    return EndpointSlice(NamespacedName("default", "lb-1"), NamespacedName("default", "lb"), "IPv4", out)


async def test_proxier_reports_ports_and_local_ready_addresses_after_a_successful_sync() -> None:
    fake, sink = FakeDatapath(), Sink()
    p = Proxier([fake], node=NodeFacts("node1"))
    p.service_health = sink
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    lb = objects_from([LB_LOCAL]).services[NamespacedName("default", "lb")]
    p.on_service_update(None, lb)
    p.on_endpoint_slice_update(None, two_port_slice("node1"))
    p.on_service_update(None, service("plain", "10.96.0.9"))
    p.on_endpoint_slice_update(None, eps("plain", "10.244.1.9", node="node1"))
    await p.sync()
    # one address serving two ports counts once; not ready and other nodes' endpoints do not count
    assert sink.calls[-1] == ({NamespacedName("default", "lb"): 30999}, {NamespacedName("default", "lb"): 1})
    fake.fail_next = 1
    p.on_endpoint_slice_update(two_port_slice("node1"), two_port_slice("node2"))
    with pytest.raises(RuntimeError):
        await p.sync()
    assert len(sink.calls) == 1  # nothing reported for a sync the datapaths did not apply
    await p.sync()
    assert sink.calls[-1] == ({NamespacedName("default", "lb"): 30999}, {})
    p.on_service_update(lb, None)
    await p.sync()
    assert sink.calls[-1] == ({}, {})


LB_LOCAL: dict[str, Any] = {
    "kind": "Service", "metadata": {"name": "lb", "namespace": "default"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.20", "externalTrafficPolicy": "Local",
             "healthCheckNodePort": 30999,
             "ports": [{"name": "http", "port": 80, "nodePort": 30080},
                       {"name": "https", "port": 443, "nodePort": 30443}]},
}


def _with(**spec: Any) -> dict[str, Any]:
    return {**LB_LOCAL, "spec": {**LB_LOCAL["spec"], **spec}}


def test_health_check_node_port_is_kept_only_for_load_balancers_with_local_policy() -> None:
    def port_of(body: dict[str, Any]) -> set[int]:
        m = objects_from([body])
        assert m.errors == []
        return {sp.health_check_node_port for sp in m.services[NamespacedName("default", "lb")].ports.values()}
    assert port_of(LB_LOCAL) == {30999}
    assert port_of(_with(externalTrafficPolicy="Cluster")) == {0}
    assert port_of(_with(type="NodePort")) == {0}
    assert port_of(_with(healthCheckNodePort=None)) == {0}


@pytest.mark.parametrize("value,message", [
    (70000, "must be between 1 and 65535, got 70000"), (-1, "must be between 1 and 65535, got -1"),
    ("30999", "must be an integer, got '30999'"), (True, "must be an integer, got True")])
def test_bad_health_check_node_port_names_service_and_field(value: object, message: str) -> None:
    m = objects_from([_with(healthCheckNodePort=value)])
    assert [str(e) for e in m.errors] == [f"Service default/lb: spec.healthCheckNodePort: {message}"]


async def test_agent_shows_a_bind_error_in_services_and_serves_once_the_port_is_free(tmp_path: Path) -> None:
    """The agent (fake datapath, NodePort addresses 127.0.0.1/32): a taken health check port is
    shown in /services with its errno, and the periodic sync takes the port once it is free."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = int(taken.getsockname()[1])
    slice_ = {"kind": "EndpointSlice", "addressType": "IPv4",
              "metadata": {"name": "lb-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "lb"}},
              "ports": [{"name": "http", "port": 8080}, {"name": "https", "port": 8443}],
              "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": "node1"}]}
    (tmp_path / "svc.yaml").write_text(yaml.safe_dump_all([_with(healthCheckNodePort=port), slice_]))
    cfg = ProxyConfig(services=tmp_path, healthz_bind_address="127.0.0.1:0", metrics_bind_address="127.0.0.1:0",
                      min_sync_period=0.05, sync_period=0.3, hostname_override="node1",
                      nodeport_addresses=("127.0.0.1/32",))
    agent = Agent(cfg, datapaths=[FakeDatapath("userspace")])
    await agent.start()
    try:
        rows = await wait_rows(agent, lambda rows: bool(rows) and rows[0]["healthCheckError"] is not None)
        assert {r["healthCheckNodePort"] for r in rows} == {port}
        assert f"cannot listen on port {port}: [Errno {errno.EADDRINUSE}] 127.0.0.1:{port}" in str(rows[0]["healthCheckError"])
        taken.close()
        await wait_rows(agent, lambda rows: rows[0]["healthCheckError"] is None)
        status, _, body = await probe(port)
        assert status == 200 and body["localEndpoints"] == 1  # 10.244.1.5 serves two ports: one address
    finally:
        taken.close()
        await agent.shutdown()


async def wait_rows(agent: Agent, cond: Any, timeout: float = 3.0) -> list[ServiceRow]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rows = await agent.services()
        if cond(rows):
            return rows
        assert asyncio.get_running_loop().time() < deadline, rows
        await asyncio.sleep(0.05)
