"""The agent with a fake datapath over real HTTP on loopback: /healthz and /livez (kube-proxy's
JSON, 503 when a queued change waited too long), /metrics with kube-proxy names, /services, a
manifest edit (atomic rename) visible within 1 s, a broken edit keeping the last good state."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import uvloop

from tests.app.helpers import SVC, closed, service_row, write
from usproxy.admin.health import Health, evaluate
from usproxy.admin.views import bpf_lb_mode
from usproxy.app.agent import Agent
from usproxy.model.config import ProxyConfig
from usproxy.sources import Source
from usproxy.core.datapath import FakeDatapath, Placement
from usproxy.util.metrics import Metrics
from usproxy.util.rows import FlowRow, ServiceRow

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
async def agent(tmp_path: Path) -> Any:
    write(tmp_path / "svc.yaml", SVC.format(port=80))
    cfg = ProxyConfig(services=tmp_path, healthz_bind_address="127.0.0.1:0",
                      metrics_bind_address="127.0.0.1:0", min_sync_period=0.05)
    a = Agent(cfg, datapaths=[FakeDatapath("userspace")])
    await a.start()
    try:
        yield a
    finally:
        await a.shutdown()


async def get(a: Agent, role: str, path: str) -> tuple[int, Any]:
    host, port = a.admin.bound[role]
    async with aiohttp.ClientSession() as s, s.get(f"http://{host}:{port}{path}") as r:
        return r.status, (await r.json() if "json" in r.content_type else await r.text())


async def wait_for(cond: Any, timeout: float = 1.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await cond():
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_healthz_livez_metrics_services(agent: Agent) -> None:
    async def synced() -> bool:
        return agent.proxier.last_updated is not None
    await wait_for(synced)
    for path in ("/healthz", "/livez"):
        status, body = await get(agent, "healthz", path)
        assert status == 200 and set(body) == {"lastUpdated", "currentTime", "nodeEligible"}
    status, text = await get(agent, "metrics", "/metrics")
    assert status == 200 and "kubeproxy_sync_proxy_rules_duration_seconds_count" in text
    assert "kubeproxy_sync_proxy_rules_last_timestamp_seconds" in text
    status, rows = await get(agent, "metrics", "/services")
    assert [(r["servicePortName"], r["port"], r["endpoints"][0]["address"]) for r in rows] == [
        ("default/web:http", 80, "10.244.1.5:8080")]


async def test_edit_shows_within_one_second_and_broken_edit_keeps_state(agent: Agent, tmp_path: Path) -> None:
    write(tmp_path / "svc.yaml", SVC.format(port=81))

    async def port_is(p: int) -> bool:
        _, rows = await get(agent, "metrics", "/services")
        return bool(rows) and rows[0]["port"] == p
    await wait_for(lambda: port_is(81))
    write(tmp_path / "svc.yaml", "kind: Service\n  broken: [")
    await asyncio.sleep(0.5)
    assert await port_is(81)
    assert agent.metrics.config_errors.labels("manifest")._value.get() >= 1


def test_health_rule_follows_kube_proxy() -> None:
    assert evaluate(None, None, 60, now=1000).healthy  # starting up
    assert evaluate(900, 990, 60, now=1000).healthy  # queued 10 s ago
    assert not evaluate(900, 930, 60, now=1000).healthy  # queued 70 s ago, never synced since


async def test_healthz_fails_while_node_is_being_deleted_livez_does_not(agent: Agent) -> None:
    class Deleting:
        node_eligible = False
    agent.source = cast(Source, Deleting())  # the only part of a Source /healthz reads
    status, body = await get(agent, "healthz", "/healthz")
    assert status == 503 and body["nodeEligible"] is False
    status, _ = await get(agent, "healthz", "/livez")
    assert status == 200


async def test_everything_withdrawn_on_a_local_error_health_port_flood_is_bounded(
        agent: Agent, monkeypatch: Any) -> None:
    """Idle clients of the health port (issue 18: they took every descriptor, and the manifest
    directory then read as empty) are bounded: over the limit the connection idle the longest is
    closed at once to make room, and a connection without a complete request head (idle, or a slow
    partial head) is closed after the idle timeout, after which /healthz answers again."""
    import usproxy.admin.server as server

    monkeypatch.setattr(server, "IDLE_TIMEOUT", 0.5)
    admin = server.AdminServer(agent, "127.0.0.1:0", "", max_connections=4)
    await admin.start()
    try:
        host, port = admin.bound["healthz"]
        idle = [await asyncio.open_connection(host, port, local_addr=(f"127.0.0.{i}", 0)) for i in (1, 2, 3)]
        slow = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
        slow[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
        await asyncio.sleep(0.1)
        start = time.monotonic()
        over = await raw_get(host, port, "/healthz", "127.0.0.4")  # the total is full
        status, body = await asyncio.wait_for(answer(over[0]), 1.0)
        assert status in (200, 503) and "nodeEligible" in json.loads(body)  # served
        assert idle[0][0].at_eof()  # the one idle the longest made room
        for reader, _ in [*idle[1:], slow, over]:
            assert await closed(reader)  # the server closed it
        assert time.monotonic() - start < 2.0
        async with aiohttp.ClientSession() as s, s.get(f"http://{host}:{port}/healthz") as r:
            assert r.status in (200, 503) and "nodeEligible" in await r.json()
        for _, writer in [*idle, slow, over]:
            writer.close()
    finally:
        await admin.stop()


async def test_everything_withdrawn_on_a_local_error_one_client_holds_at_most_half_the_health_port(
        agent: Agent) -> None:
    """One address holding idle connections gets at most half of the listener's connections, so a
    load balancer's probe from another address is still answered; the hog's next one closes the
    hog's own connection idle the longest, not another address's (older) one."""
    import usproxy.admin.server as server

    admin = server.AdminServer(agent, "127.0.0.1:0", "", max_connections=4)
    await admin.start()
    try:
        host, port = admin.bound["healthz"]
        other = await asyncio.open_connection(host, port, local_addr=("127.0.0.5", 0))  # idle the longest
        hog = [await asyncio.open_connection(host, port, local_addr=("127.0.0.66", 0)) for _ in range(2)]
        await asyncio.sleep(0.05)
        hog.append(await asyncio.open_connection(host, port, local_addr=("127.0.0.66", 0)))
        assert await closed(hog[0][0])  # its third: its own first made room
        for probe in ("127.0.0.2", "127.0.0.3"):
            conn = aiohttp.TCPConnector(local_addr=(probe, 0), force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://{host}:{port}/healthz") as r:
                assert r.status in (200, 503) and "nodeEligible" in await r.json()
        for reader, _ in [other, *hog[1:]]:
            assert not reader.at_eof()  # still open (served, idle)
        for _, writer in [other, *hog]:
            writer.close()
    finally:
        await admin.stop()


class SlowView:
    """An AdminView whose /services answer waits for `release`: a request in flight for as long
    as a test wants."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.release = asyncio.Event()
        self.asked = asyncio.Event()

    def health(self) -> Health:
        return evaluate(None, None, 60)

    async def services(self) -> list[ServiceRow]:
        self.asked.set()
        await self.release.wait()
        return [service_row(f"default/s{i}:http") for i in range(1000)]

    async def flows(self) -> list[FlowRow]:
        return []


async def raw_get(host: str, port: int, path: str, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keep-alive GET of `path` from `source`, its answer not read yet."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and the body (Content-Length long) of one HTTP/1.1 answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length")
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def hog_on_the_probers_address(idle_count: int) -> None:
    """The admin server (limit 4, share 2) with one /services request in flight from 127.0.0.1,
    then `idle_count` idle connections from 127.0.0.1 and 127.0.0.2 (the limit full): a /healthz
    probe from 127.0.0.1 (its share full) and one from 127.0.0.3 (the total full) are answered
    within a second, each closing one idle connection; the request in flight is answered whole."""
    from usproxy.admin.server import AdminServer

    view = SlowView()
    admin = AdminServer(view, "127.0.0.1:0", "127.0.0.1:0", max_connections=4)
    await admin.start()
    try:
        host, port = admin.bound["healthz"]
        busy = await raw_get(host, port, "/services", "127.0.0.1")
        await asyncio.wait_for(view.asked.wait(), 2)
        idle = [await asyncio.open_connection(host, port, local_addr=(f"127.0.0.{1 + i % 2}", 0))
                for i in range(idle_count)]
        await asyncio.sleep(0.05)  # every handler started: idle, waiting for a request head
        for source in ("127.0.0.1", "127.0.0.3"):
            start = time.monotonic()
            reader, writer = await raw_get(host, port, "/healthz", source)
            status, body = await asyncio.wait_for(answer(reader), 1.0)
            assert status == 200 and "nodeEligible" in json.loads(body)
            assert time.monotonic() - start < 1.0
            writer.close()
        assert not busy[0].at_eof()  # never closed: its request is in flight
        assert sum(r.at_eof() for r, _ in idle) == 2  # one closed per probe, no more
        view.release.set()
        status, body = await asyncio.wait_for(answer(busy[0]), 5)
        assert status == 200 and len(json.loads(body)) == 1000
        for _, writer in [busy, *idle]:
            writer.close()
    finally:
        view.release.set()  # else stopping waits for the request in flight
        await admin.stop()


async def every_connection_busy_refuses_the_next() -> None:
    """When every connection has a request in flight nothing is closed: the new one is reset."""
    from usproxy.admin.server import AdminServer

    view = SlowView()
    admin = AdminServer(view, "127.0.0.1:0", "127.0.0.1:0", max_connections=4)
    await admin.start()
    try:
        host, port = admin.bound["healthz"]
        busy = [await raw_get(host, port, "/services", f"127.0.0.{1 + i % 2}") for i in range(4)]
        await asyncio.sleep(0.1)
        over = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
        assert await closed(over[0])  # reset at once, never served
        over[1].close()
        view.release.set()
        for reader, writer in busy:
            status, body = await asyncio.wait_for(answer(reader), 5)
            assert status == 200 and len(json.loads(body)) == 1000
            writer.close()
    finally:
        view.release.set()
        await admin.stop()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_everything_withdrawn_on_a_local_error_a_hog_on_the_probers_address_cannot_starve_it(loop: str) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(hog_on_the_probers_address(3))
        runner.run(every_connection_busy_refuses_the_next())


def test_everything_withdrawn_on_a_local_error_admin_connections_scale_with_the_descriptor_limit() -> None:
    """Under a low descriptor limit the admin listeners together take at most 1/8 of it, within
    the quarter the relay reserves (FD_RESERVE); never more than MAX_CONNECTIONS each."""
    from usproxy.admin.server import MAX_CONNECTIONS, connection_limit

    assert connection_limit(256) == 16 and 2 * connection_limit(256) <= 256 // 8
    assert connection_limit(1 << 20) == MAX_CONNECTIONS


def test_bpf_lb_mode_is_said_for_every_frontend_served_at_tc(tmp_path: Path) -> None:
    """/services' bpfLbMode follows where external traffic goes, not whether a NodePort exists:
    a ServicePort with only externalIPs or LoadBalancer IPs served at tc takes DSR too."""
    assert bpf_lb_mode("dsr", Placement("tc", "externalIPs only")) == "dsr"
    assert bpf_lb_mode("snat", Placement("tc", "")) == "snat"
    assert bpf_lb_mode("dsr", Placement("nftables", "IPv6 frontends")) is None  # the fallback has no mode
    assert bpf_lb_mode("dsr", Placement("relay", "not offloaded")) is None
    assert bpf_lb_mode("dsr", None) is None  # no frontend outside the node
    # the agent gives a mode only when --offload bpf can run tc programs
    assert Agent(ProxyConfig(services=tmp_path, offload="nftables", bpf_lb_mode="dsr"), []).views.bpf_lb_mode is None
    assert Agent(ProxyConfig(services=tmp_path, offload="bpf", bpf_lb_mode="dsr"), []).views.bpf_lb_mode == "dsr"
