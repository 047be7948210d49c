"""The web view without a browser: the EventHub's bounds (a subscriber that never reads holds at
most LIMIT events and one snapshot), a stalled page dropped without delaying /metrics, the page
and its assets served from the package with nothing from the internet, /view/service giving the
five modes' drawings and explain's own rules for the agent's current Service, and the stream's
first snapshot equal to /services. The drawings themselves: tests/explain/test_drawing.py."""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from usproxy.admin import web_view
from usproxy.core.events import EventHub, Subscription
from usproxy.app.agent import Agent
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import FakeDatapath
from usproxy.explain import nftables, registry, scale
from usproxy.offload.iptables import rules as iptables
from usproxy.model.service_set import ServiceSet

from tests.app.helpers import SVC, write

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
async def agent(tmp_path: Path) -> Any:
    write(tmp_path / "svc.yaml", SVC.format(port=80))
    cfg = ProxyConfig(services=tmp_path, healthz_bind_address="127.0.0.1:0",
                      metrics_bind_address="127.0.0.1:0", min_sync_period=0.05)
    a = Agent(cfg, datapaths=[FakeDatapath("userspace")])
    await a.start()
    try:
        while a.proxier.last_updated is None:
            await asyncio.sleep(0.02)
        yield a
    finally:
        await a.shutdown()


def url(a: Agent, path: str) -> str:
    host, port = a.admin.bound["metrics"]
    return f"http://{host}:{port}{path}"


async def test_a_subscriber_that_never_reads_holds_a_bounded_queue() -> None:
    hub = EventHub()
    slow = hub.subscribe()
    for i in range(3 * Subscription.LIMIT):
        hub.publish("demoted", n=i)
        hub.publish("snapshot", n=i)
    assert len(slow.events) == Subscription.LIMIT and slow.dropped == 2 * Subscription.LIMIT
    got = await slow.next(0)
    assert [e.data["n"] for e in got[:-1]] == list(range(2 * Subscription.LIMIT, 3 * Subscription.LIMIT))
    assert got[-1].kind == "snapshot" and got[-1].data["n"] == 3 * Subscription.LIMIT - 1  # only the latest
    assert await slow.next(0.01) == []
    late = hub.subscribe()  # a page opened later sees the recent events, not the snapshots
    assert [e.data["n"] for e in await late.next(0)] == list(range(3 * Subscription.LIMIT - EventHub.RECENT,
                                                                  3 * Subscription.LIMIT))
    late.close()
    slow.close()
    assert not hub.subscribers


async def test_a_stalled_page_is_dropped_and_metrics_stay_fast(agent: Agent, monkeypatch: Any) -> None:
    """A page that stops reading its stream: the server's writes stall, the stream is closed after
    WRITE_TIMEOUT, and /metrics answers quickly all along."""
    monkeypatch.setattr(web_view, "WRITE_TIMEOUT", 0.5)
    host, port = agent.admin.bound["metrics"]
    reader, writer = await asyncio.open_connection(host, port, limit=1024)
    writer.transport.set_write_buffer_limits(0)
    writer.write(b"GET /view/stream HTTP/1.1\r\nHost: x\r\n\r\n")
    big = "x" * 300_000
    async with aiohttp.ClientSession() as s:
        for _ in range(60):  # ~18 MB for a page that reads nothing
            agent.events.publish("demoted", servicePortName="default/web:http", datapath="userspace", reason=big)
            start = time.monotonic()
            async with s.get(url(agent, "/metrics")) as r:
                assert r.status == 200
            assert time.monotonic() - start < 0.5
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 5
        while agent.events.subscribers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not agent.events.subscribers  # dropped, its queue released
    writer.close()


async def test_a_page_that_falls_behind_is_told_how_many_events_it_missed(agent: Agent, monkeypatch: Any) -> None:
    monkeypatch.setattr(Subscription, "LIMIT", 4)
    async with aiohttp.ClientSession() as s, s.get(url(agent, "/view/stream")) as r:
        assert (await asyncio.wait_for(r.content.readline(), 2)) == b"event: snapshot\n"
        while agent.events.subscribers and next(iter(agent.events.subscribers)).events:
            await asyncio.sleep(0.01)  # the server has written everything queued so far
        for i in range(10):  # published between two reads of the server: 6 dropped
            agent.events.publish("demoted", servicePortName="default/web:http", datapath="userspace", reason=str(i))
        seen: list[str] = []
        while "event: lagged" not in seen:
            seen.append((await asyncio.wait_for(r.content.readline(), 2)).decode().strip())
        lagged = json.loads((await r.content.readline()).decode().removeprefix("data: "))
    reasons = [json.loads(x.removeprefix("data: "))["reason"] for x in seen if '"demoted"' in x]
    assert reasons == ["6", "7", "8", "9"] and lagged == {"dropped": 6}


async def test_page_and_assets_come_from_the_package_only(agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        texts = []
        for path in ("/view", "/view/static/view.js", "/view/static/view.css", "/view/static/explain.css"):
            async with s.get(url(agent, path)) as r:
                assert r.status == 200
                texts.append(await r.text())
        for path in ("/view/static/..%2fserver.py", "/view/static/view.html.bak"):
            async with s.get(url(agent, path)) as r:
                assert r.status == 404
    refs = re.findall(r'(?:src|href)="([^"#][^"]*)"', texts[0])  # in-page anchors (#numbers) load nothing
    assert refs == ["/view/static/explain.css", "/view/static/view.css", "/view/static/view.js"]
    assert not any(re.search(r"https?://|//[a-z]", t.replace("http://www.w3.org", "")) for t in texts[1:])


async def test_service_detail_draws_every_mode_next_to_explains_rules(agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/view/service?name=default/web")) as r:
            body = await r.json()
        async with s.get(url(agent, "/view/service?name=default/nothing")) as r:
            assert r.status == 404
    assert [m["mode"] for m in body["modes"]] == ["userspace", "iptables", "ipvs", "nftables", "bpf"]
    st = agent.service_ports()[0]
    ss = ServiceSet(((st.service_port, st.endpoints),))
    rules = {m["mode"]: m["rules"] for m in body["modes"]}
    assert rules["iptables"] == iptables.render(ss) and rules["nftables"] == nftables.render(ss)
    for m in body["modes"]:
        (svg,) = m["svgs"]
        root = ET.fromstring(svg)
        backends = [g.get("data-endpoint") for g in root.iter(f"{SVG}g") if g.get("class") == "backend"]
        assert root.get("data-mode") == m["mode"] and backends == ["10.244.1.5:8080"]


async def test_the_stream_starts_with_a_snapshot_of_services_and_flows(agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/services")) as r:
            services = await r.json()
        async with s.get(url(agent, "/view/stream")) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            lines: list[str] = []
            while len(lines) < 2:
                lines.append((await asyncio.wait_for(r.content.readline(), 2)).decode().strip())
    assert lines[0] == "event: snapshot"
    snap = json.loads(lines[1].removeprefix("data: "))
    for row in (*snap["services"], *services):
        row.pop("reason")  # the fake datapath's reason carries no clock, but stay safe
    assert snap["services"] == services and snap["flows"] == [] and snap["flowCount"] == 0


# `nft list table ip usproxy` as the nftables datapath leaves it for tests/app/helpers.SVC (trimmed
# to what default/web:http uses), the way the kernel lists it back.
LISTING = """table ip usproxy {
\tmap service-ips {
\t\ttype ipv4_addr . inet_proto . inet_service : verdict
\t\telements = { 10.96.10.10 . tcp . 80 comment "default/web:http/TCP" : goto g-1,
\t\t\t     10.96.0.10 . udp . 53 comment "kube-system/dns:dns/UDP" : goto g-1 }
\t}

\tmap slot-0 {
\t\ttype ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service
\t\telements = { 10.96.10.10 . tcp . 80 : 10.244.1.5 . 8080,
\t\t\t     10.96.0.10 . udp . 53 : 10.244.9.9 . 53 }
\t}

\tchain services {
\t\tip daddr . meta l4proto . th dport vmap @service-ips
\t}

\tchain nat-prerouting {
\t\ttype nat hook prerouting priority dstnat; policy accept;
\t\tjump services
\t}

\tchain g-1 {
\t\tgoto s-0
\t}

\tchain s-0 {
\t\tdnat ip to ip daddr . meta l4proto . th dport map @slot-0
\t}
}
"""


async def test_the_page_carries_the_introduction(agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/view")) as r:
            page = await r.text()
    assert "<!--intro-->" not in page and "<b>Service</b> is a stable address" in page
    for mode in registry.MODES:
        assert f"<li><b>{mode.name}</b>: {html.escape(mode.gist)}</li>" in page, mode.name


async def test_why_in_numbers_measures_the_nodes_services(agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/view/numbers")) as r:
            body = await r.json()
    rows = re.findall(r"<tr><td>(\w+)</td><td>(\d+)</td>", body["html"])
    assert [m for m, _ in rows] == list(registry.NAMES)
    st = agent.service_ports()[0]
    ss = ServiceSet(((st.service_port, st.endpoints),))
    walked = {m.name: scale.measure(ss, m, lambda x, md: md.view(x, "dump")).rules for m in registry.MODES}
    assert {m: int(n) for m, n in rows} == walked


async def test_nftables_shows_usproxys_own_table_as_the_kernel_lists_it(agent: Agent, monkeypatch: Any) -> None:
    """With an nftables datapath running, the nftables mode carries default/web's part of the
    table the kernel lists (read through web_view.live_tables) and its drawing; without one,
    nothing is read."""
    reads: list[int] = []

    def listed() -> dict[int, str]:
        reads.append(1)
        return {4: LISTING}

    monkeypatch.setattr(web_view, "live_tables", listed)
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/view/service?name=default/web")) as r:
            plain = await r.json()
        monkeypatch.setattr(agent, "kernel_datapaths", lambda: ("nftables",))
        for _ in range(2):  # one reading serves both (LIVE_TABLE_AGE)
            async with s.get(url(agent, "/view/service?name=default/web")) as r:
                body = await r.json()
    assert reads == [1] and all("live" not in m for m in plain["modes"])
    (nft,) = [m for m in body["modes"] if "live" in m]
    assert nft["mode"] == "nftables" and nft["live"]["title"] == "usproxy's own table, as the kernel holds it now"
    rules = nft["live"]["rules"]
    assert '\t10.96.10.10 . tcp . 80 comment "default/web:http/TCP" : goto g-1' in rules
    assert "\t10.96.10.10 . tcp . 80 : 10.244.1.5 . 8080" in rules and "10.244.9.9" not in rules
    assert "chain g-1 {" in rules and "chain s-0 {" in rules
    (svg,) = nft["live"]["svgs"]
    root = ET.fromstring(svg)
    assert [g.get("data-endpoint") for g in root.iter(f"{SVG}g") if g.get("class") == "backend"] == ["10.244.1.5:8080"]
    assert "g-1" in svg and "@service-ips" in svg


async def test_a_tours_plots_are_served_only_when_given(tmp_path: Path, agent: Agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(agent, "/view/tour")) as r:
            assert await r.json() == {"html": None}
    plots = tmp_path / "tour"
    plots.mkdir()
    (plots / "match-cost.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    write(tmp_path / "svc.yaml", SVC.format(port=80))
    cfg = ProxyConfig(services=tmp_path / "svc.yaml", healthz_bind_address="127.0.0.1:0",
                      metrics_bind_address="127.0.0.1:0", tour_results=plots)
    a = Agent(cfg, datapaths=[FakeDatapath("userspace")])
    await a.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url(a, "/view/tour")) as r:
                body = await r.json()
    finally:
        await a.shutdown()
    assert 'alt="match-cost.svg"' in body["html"] and "<figcaption>match-cost.svg</figcaption>" in body["html"]
