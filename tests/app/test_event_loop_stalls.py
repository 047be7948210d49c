"""Class "event-loop stalls" (issue 18, item 4): /services was quadratic in endpoints (a tuple
scan per endpoint: 10,000 endpoints froze the relay 8.8 s) and /flows built 9,800 rows in one
piece on the loop. The view is computed from sets (counted: no endpoint comparison grows with
the endpoint count), and both views are built in chunks with the loop running in between
(counted: the loop gets a turn every VIEW_CHUNK rows).

The other tests measure the loop's worst gap with a ticker beside the real work (WorstGap), in
this process's CPU time (so other processes on a loaded machine do not count), and assert a
generous bound that the old code clearly broke:
- a relist of 100 slices x 1,000 endpoints (~2 s in one piece; 78 s with all 100 slices in one
  Service), into a real Proxier: 100 ms (the fix gives ~20-50 ms);
- a list page of ~6 MB from the fake API server (decoded on the loop: ~0.12 s): 50 ms;
- /services of 5,000 Services of 8 endpoints (1.5 s), /flows of 10,000 flows (0.5 s), the web
  view's first snapshot (0.3 s), one Service's drawings among 5,000 (75 ms; and counted: only
  its own ports' states are computed) and /metrics (~10 ms), asked by clients in their own
  processes: 50 ms (the fix gives a median of ~4-10 ms and a worst of 23 ms over 5 runs with two
  other processes keeping both cores busy: what is left is mostly a worker thread's CPU while
  the loop's thread waits for a core, so the bound stays where a loaded machine cannot reach it);
- a full collection after the sync of those 5,000 Services (~130 ms of CPU): 20 ms (~0.2 ms);
- a manifest of 20,000 endpoints rewritten, up to its delivery: 100 ms;
- the sync after it (the endpoints merged and compared on the loop: ~0.2 s): 100 ms.
They run with the switch interval `usproxy run` sets (1 ms: a worker thread hands the GIL back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import sys
import tempfile
import time
import weakref
from asyncio.subprocess import PIPE
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from tests.sources.conftest import FAST, eps, eventually, svc
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text
from usproxy.util import gc_pause
from usproxy.explain import registry
from usproxy.core.events import EventHub
from usproxy.admin.snapshot import JOIN, SharedBuild, encode_and_free, rows_json, rows_json_pretty
from usproxy.admin.web_view import MAX_FLOWS, snapshot_json
from usproxy.admin.views import VIEW_CHUNK
from usproxy.app.agent import Agent
from usproxy.app.cli import SWITCH_INTERVAL
from usproxy.model.config import ProxyConfig
from usproxy.flows.flow_table import Flow, FlowTable
from usproxy.core.datapath import FakeDatapath, ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.core.proxier import PLACEMENT_CHUNK, Proxier
from usproxy.model.service import Service, parse_service
from usproxy.util.errors import SourceError
from usproxy.sources.api_list_watch import ENDPOINT_SLICES, ApiListWatch, decode_json, decode_list
from usproxy.sources.kube import KubeSource, client_config
from usproxy.sources.static import StaticSource
from usproxy.sources.reflector import Gone, ListResult, Reflector, WatchEvent
from usproxy.model.types import ServicePortName
from usproxy.util.rows import FlowRow, ServiceRow

N = 2000
WEB = ServicePortName("default", "web", "http", "TCP")


def manifest(n: int) -> str:
    """A Service with `n` endpoints, in slices of at most 1,000 (the API server's limit)."""
    out = """apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.10.10, ports: [{name: http, port: 80}]}
"""
    for first in range(0, n, 1000):
        eps = ",".join(f"{{addresses: [10.1.{i // 256}.{i % 256}]}}" for i in range(first, min(n, first + 1000)))
        out += f"""---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-{first // 1000 + 1}, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{eps}]
"""
    return out


@pytest.fixture(autouse=True)
def as_run() -> Iterator[None]:
    """What `usproxy run` sets (usproxy.app.cli): worker threads hand the GIL back every 1 ms. And
    what a large sync froze (gc_pause.freeze_heap) is given back to the collector afterwards, so
    the tests after these see the heap as before."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        gc.unfreeze()


@pytest.fixture
async def agent(tmp_path: Path) -> Any:
    (tmp_path / "svc.yaml").write_text(manifest(N))
    a = Agent(ProxyConfig(services=tmp_path, healthz_bind_address="", metrics_bind_address="",
                          min_sync_period=0.05), datapaths=[FakeDatapath("userspace")])
    await a.start()
    try:
        deadline = time.monotonic() + 10
        while len(a.proxier.endpoints_map.get(WEB, ())) < N and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(a.proxier.endpoints_map.get(WEB, ())) == N
        yield a
    finally:
        await a.shutdown()


async def ticks_during(coro: Any) -> tuple[Any, int]:
    """The result of `coro` and how many turns a task running beside it got."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    try:
        result = await coro
    finally:
        task.cancel()
    return result, ticks - start


async def test_event_loop_stalls_services_view_compares_no_endpoint_pairs(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    compared = 0
    eq = Endpoint.__eq__

    def counting(self: Endpoint, other: object) -> bool:
        nonlocal compared
        compared += 1
        return eq(self, other)

    monkeypatch.setattr(Endpoint, "__eq__", counting)
    rows = await agent.views.services(chunk=10**9)  # in one piece
    assert len(rows[0]["endpoints"]) == N and all(e["usable"] for e in rows[0]["endpoints"])
    assert compared < N  # a tuple scan per endpoint made ~N*N/2 = 2,000,000 comparisons


async def test_event_loop_stalls_services_yields_every_chunk(agent: Agent) -> None:
    rows, ticks = await ticks_during(agent.services())
    assert rows == await agent.views.services(chunk=10**9)
    assert ticks >= N // VIEW_CHUNK


class ChunkedRelay:
    """The relay's /flows surface over a real FlowTable."""

    def __init__(self, table: FlowTable) -> None:
        self.table = table

    def flows_chunks(self, size: int) -> Iterator[list[FlowRow]]:
        return self.table.view_chunks(size)


def flow_table(n: int) -> FlowTable:
    table = FlowTable(n)
    for i in range(n):
        table.add(Flow("TCP", WEB, (f"10.0.{i // 256}.{i % 256}", 40000), ("10.96.10.10", 80)))
    return table


def test_event_loop_stalls_flow_table_chunks_are_the_view() -> None:
    table = flow_table(2 * VIEW_CHUNK + 7)
    chunks = list(table.view_chunks(VIEW_CHUNK))
    assert [len(c) for c in chunks] == [VIEW_CHUNK, VIEW_CHUNK, 7]
    assert [r["id"] for c in chunks for r in c] == [r["id"] for r in table.view()]


async def test_event_loop_stalls_flows_yields_every_chunk(tmp_path: Path) -> None:
    table = flow_table(5 * VIEW_CHUNK)
    a = Agent(ProxyConfig(services=tmp_path, healthz_bind_address="", metrics_bind_address=""),
              datapaths=[FakeDatapath("userspace")])
    a.datapaths.append(ChunkedRelay(table))  # type: ignore[arg-type]  # only its /flows surface is read
    rows, ticks = await ticks_during(a.flows())
    assert [r["id"] for r in rows] == [r["id"] for r in table.view()]
    assert ticks >= 5


# -- relists --------------------------------------------------------------------------------------
SLICES, PER_SLICE = 100, 1000
STALL_BOUND = 0.100  # seconds; generous for a loaded 2-core machine
ADMIN_BOUND = 0.050  # seconds, for work off the loop (a list page decoded, an admin view encoded)
GC_BOUND = 0.020  # seconds of CPU, a full collection after a large sync (~0.2 ms; it was ~130 ms)


def raw_slice(i: int, port: int) -> dict[str, Any]:
    return {"metadata": {"name": f"big-{i}", "namespace": "default", "resourceVersion": str(port),
                         "labels": {"kubernetes.io/service-name": "big"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [f"10.{i}.{j // 256}.{j % 256}"], "conditions": {"ready": True},
                           "nodeName": "node-a"} for j in range(PER_SLICE)]}


class Relists:
    """A ListWatch whose lists hand out `lists` in turn; each watch but the last answers 410 Gone
    (the reflector relists), the last one stays open."""

    def __init__(self, lists: list[list[dict[str, Any]]]) -> None:
        self.lists = lists
        self.listed = 0

    async def list(self, resource_version: str) -> ListResult:
        self.listed += 1
        return ListResult(self.lists[self.listed - 1], str(self.listed))

    async def watch(self, resource_version: str, timeout: float) -> AsyncGenerator[WatchEvent, None]:
        if self.listed < len(self.lists):
            raise Gone("Expired: too old resource version")
        await asyncio.Event().wait()
        yield WatchEvent(type="BOOKMARK", object={})  # never reached


class WorstGap:
    """A task beside the work: the longest time the loop did not come back to it, in seconds of
    this process's CPU time (`worst`: what our own work cost, steady on a machine where other
    processes take the CPUs too) and of wall time (`worst_wall`, printed only). The gap still
    open when the block ends counts too (work that ends the block never let the task run)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_wall = 0.0
        self._last = (time.process_time(), time.perf_counter())
        self._task: asyncio.Task[None] | None = None

    def _tock(self) -> None:
        now, now_wall = time.process_time(), time.perf_counter()
        self.worst = max(self.worst, now - self._last[0])
        self.worst_wall = max(self.worst_wall, now_wall - self._last[1])
        self._last = (now, now_wall)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self._tock()

    def __enter__(self) -> WorstGap:
        self._last = (time.process_time(), time.perf_counter())
        self._task = asyncio.create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self._tock()


async def test_event_loop_stalls_relist_of_100_000_endpoints(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_text("https://127.0.0.1:1", "token"))
    proxier = Proxier([FakeDatapath("userspace")])
    source = KubeSource(ProxyConfig(kubeconfig=kubeconfig), proxier, node_name="node-a")
    first, second = ([raw_slice(i, port) for i in range(SLICES)] for port in (8080, 8081))
    lw = Relists([first, second])
    reflector = Reflector("EndpointSlices", lw, source.slices, FAST)
    big = ServicePortName("default", "big", "http", "TCP")
    with WorstGap() as gap:
        task = asyncio.create_task(reflector.run())
        try:
            await eventually(lambda: reflector.lists == 2, timeout=120, what="the list and the relist")
        finally:
            task.cancel()
    print(f"relist of {SLICES} x {PER_SLICE} endpoints: worst loop gap {gap.worst * 1000:.1f} ms CPU, "
          f"{gap.worst_wall * 1000:.1f} ms wall")
    assert proxier.endpoints_tracker.pending_count() == 1  # one ServicePort changed, tracked
    assert {e.port for s in source.slices.objects.values() for e in s.endpoints[big]} == {8081}
    assert sum(len(s.endpoints[big]) for s in source.slices.objects.values()) == SLICES * PER_SLICE
    assert gap.worst < STALL_BOUND



# -- a list page from the API server ----------------------------------------------------------------
PAGE_SLICES = 75  # EndpointSlices of 1,000 endpoints in one page: ~6 MB of JSON
SLOW_LIST = dataclasses.replace(FAST, list_timeout=30.0, read_timeout=30.0)  # a loaded machine


async def test_event_loop_stalls_list_page_of_6_mb(tmp_path: Path) -> None:
    from kubernetes_asyncio.client import ApiClient

    api = FakeApiServer()
    await api.start()
    try:
        for i in range(PAGE_SLICES):
            api.apply("endpointslices", raw_slice(i, 8080))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kubeconfig_text(api.url, api.token))
        async with ApiClient(await client_config(kubeconfig)()) as client:
            lw = ApiListWatch(client, ENDPOINT_SLICES, options=SLOW_LIST)
            with WorstGap() as gap:
                result = await lw.list("")
    finally:
        await api.stop()
    print(f"list page of {PAGE_SLICES} x {PER_SLICE} endpoints: worst loop gap {gap.worst * 1000:.1f} ms CPU, "
          f"{gap.worst_wall * 1000:.1f} ms wall")
    assert len(json.dumps(result.items)) > 5_000_000  # one page (the page size is 500) of ~6 MB
    assert [q.get("limit") for r, q in api.requests if r == "endpointslices"] == [str(SLOW_LIST.page_size)]
    assert result.items == [{k: v for k, v in o.items() if k != "__resource__"}
                            for _, o in sorted(api.objects["endpointslices"].items())]
    assert result.resource_version == str(api.rv)
    assert gap.worst < ADMIN_BOUND


# -- admin requests -------------------------------------------------------------------------------
SERVICES, ENDPOINTS = 5000, 8  # Services and endpoints of each: a /services poll stalled the relay > 0.5 s
FLOWS = 10_000  # relayed flows: /flows cost 0.15-0.19 s per request on the loop


def many_services(n: int) -> tuple[list[Service], list[EndpointSlice]]:
    services, slices = [], []
    for i in range(n):
        name = f"s{i}"
        services.append(parse_service(svc(name, f"10.96.{i // 250}.{i % 250 + 1}")))
        ips = [f"10.{j + 1}.{i // 250}.{i % 250 + 1}" for j in range(ENDPOINTS)]
        slices.append(parse_endpoint_slice(eps(f"{name}-1", name, ips)))
    return services, slices


@pytest.fixture
async def big_agent(tmp_path: Path) -> Any:
    """An agent serving admin on loopback with SERVICES Services (fed to its Proxier directly:
    parsing them from YAML takes longer than the test) and a relay flow table of FLOWS flows."""
    a = Agent(ProxyConfig(services=tmp_path, healthz_bind_address="127.0.0.1:0",
                          metrics_bind_address="127.0.0.1:0", min_sync_period=0.05),
              datapaths=[FakeDatapath("userspace")])
    a.datapaths.append(ChunkedRelay(flow_table(FLOWS)))  # type: ignore[arg-type]  # only its /flows surface is read
    await a.start()
    try:
        services, slices = many_services(SERVICES)
        for s in services:
            a.proxier.on_service_update(None, s)
        for e in slices:
            a.proxier.on_endpoint_slice_update(None, e)
        await eventually(lambda: len(a.proxier.service_map) == SERVICES and a.proxier.oldest_queued is None,
                         timeout=30, what="the Services synced")
        yield a
    finally:
        await a.shutdown()


# A client in its own process (so that only the agent's work counts in this process's CPU time):
# it GETs argv[1] once told to on stdin, writes the body to the file argv[2] (read after the
# measurement: reading 10 MB from a pipe here cost this loop ~9 ms) and the status to stdout.
CLIENT = """import sys, urllib.request
sys.stdin.readline()
with urllib.request.urlopen(sys.argv[1], timeout=60) as r, open(sys.argv[2], "wb") as f:
    f.write(r.read())
    sys.stdout.write(str(r.status))
"""


async def admin_get_raw(a: Agent, path: str, out: Path, clients: int = 1) -> tuple[list[bytes], float]:
    """GET `path` from the metrics listener by `clients` clients at once: their bodies and the
    loop's worst gap while they were served (in CPU seconds, as WorstGap)."""
    host, port = a.admin.bound["metrics"]
    files = [out / f"body-{i}" for i in range(clients)]
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, f"http://{host}:{port}{path}",
                                                  str(f), stdin=PIPE, stdout=PIPE) for f in files]
    with WorstGap() as gap:
        outs = await asyncio.gather(*(p.communicate(b"go\n") for p in procs))
    print(f"GET {path} x {clients}: worst loop gap {gap.worst * 1000:.1f} ms CPU, {gap.worst_wall * 1000:.1f} ms wall")
    assert all(p.returncode == 0 and out == b"200" for p, (out, _) in zip(procs, outs))
    return [f.read_bytes() for f in files], gap.worst


async def admin_get(a: Agent, path: str, clients: int = 1) -> tuple[list[Any], float]:
    """`admin_get_raw` of a JSON answer: the decoded bodies and the worst gap."""
    with tempfile.TemporaryDirectory() as out:
        bodies, worst = await admin_get_raw(a, path, Path(out), clients)
    return [json.loads(b) for b in bodies], worst


async def test_event_loop_stalls_services_of_5000_services(big_agent: Agent) -> None:
    (rows, again), worst = await admin_get(big_agent, "/services", clients=2)
    assert rows == again == await big_agent.services()
    assert len(rows) == SERVICES and all(len(r["endpoints"]) == ENDPOINTS for r in rows)
    assert worst < ADMIN_BOUND


async def test_event_loop_stalls_flows_of_10000_flows(big_agent: Agent) -> None:
    (rows, again), worst = await admin_get(big_agent, "/flows", clients=2)
    assert [r["id"] for r in rows] == [r["id"] for r in again] == list(range(1, FLOWS + 1))
    assert worst < ADMIN_BOUND


async def test_event_loop_stalls_metrics_of_5000_services(big_agent: Agent, tmp_path: Path) -> None:
    """/metrics counted every ServicePort's placement in one piece (~10 ms at 5,000); it is
    counted PLACEMENT_CHUNK at a time (counted: the loop gets a turn between chunks)."""
    (body, again), worst = await admin_get_raw(big_agent, "/metrics", tmp_path, clients=2)
    for text in (body.decode(), again.decode()):
        assert f'usproxy_service_ports{{datapath="userspace"}} {float(SERVICES)}' in text
        assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in text
    _, ticks = await ticks_during(big_agent.metrics.scrape())
    assert ticks >= SERVICES // PLACEMENT_CHUNK
    assert worst < ADMIN_BOUND


async def test_event_loop_stalls_full_collection_after_a_large_sync(big_agent: Agent) -> None:
    """A full collection walked every Service, endpoint and row the large sync built (~220,000
    objects: 0.1-0.3 s on a loaded machine, with the GIL held); after the sync froze them it
    walks only what came since."""
    assert gc.get_freeze_count() > SERVICES * ENDPOINTS
    start = time.process_time()
    gc.collect()
    took = time.process_time() - start
    print(f"full collection after a sync of {SERVICES} Services: {took * 1000:.1f} ms CPU")
    assert took < GC_BOUND


class Cyclic:
    """An object in a reference cycle with itself (only the collector frees it)."""

    def __init__(self) -> None:
        self.me = self


def test_event_loop_stalls_frozen_cycles_reclaimed_after_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cycle alive at a freeze and dropped later survives collections until a freeze
    RECLAIM_INTERVAL after the last reclaim gives the frozen heap back and collects it."""
    monkeypatch.setattr(gc_pause, "_last_reclaim", None)
    now = 1000.0
    obj = Cyclic()
    ref = weakref.ref(obj)
    gc_pause.freeze_heap(lambda: now)
    del obj
    gc.collect()
    assert ref() is not None  # frozen: no collection sees it
    gc_pause.freeze_heap(lambda: now + gc_pause.RECLAIM_INTERVAL - 1)
    assert ref() is not None
    gc_pause.freeze_heap(lambda: now + gc_pause.RECLAIM_INTERVAL)
    assert ref() is None and gc.get_freeze_count() > 0


async def first_event(a: Agent) -> tuple[bytes, float]:
    """The first server-sent event of /view/stream (lines too long for readline) and the loop's
    worst gap while it was built and sent."""
    host, port = a.admin.bound["metrics"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{host}:{port}/view/stream") as r:
            chunks: list[bytes] = []
            tail = b""  # the last chunk and the byte before it: an event ends with a blank line
            with WorstGap() as gap:
                while b"\n\n" not in tail:
                    chunk = await r.content.read(1 << 16)
                    assert chunk, "the stream ended before its first event"
                    chunks.append(chunk)
                    tail = tail[-1:] + chunk
    print(f"web view snapshot: worst loop gap {gap.worst * 1000:.1f} ms CPU, {gap.worst_wall * 1000:.1f} ms wall")
    return b"".join(chunks).split(b"\n\n")[0], gap.worst


async def test_event_loop_stalls_web_view_snapshot_of_5000_services(big_agent: Agent) -> None:
    event, worst = await first_event(big_agent)
    kind, data = event.decode().split("\n")
    snap = json.loads(data.removeprefix("data: "))
    assert kind == "event: snapshot" and snap["kind"] == "snapshot"
    assert snap["services"] == await big_agent.services()
    assert [f["id"] for f in snap["flows"]] == list(range(1, MAX_FLOWS + 1)) and snap["flowCount"] == FLOWS
    assert worst < ADMIN_BOUND


async def test_event_loop_stalls_web_view_one_service_of_5000(big_agent: Agent,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    proxier = big_agent.proxier
    states: list[ServicePortName] = []
    state_of = proxier.state_of
    def recorded(spn: ServicePortName) -> ServicePortState | None:
        states.append(spn)
        return state_of(spn)

    monkeypatch.setattr(proxier, "state_of", recorded)
    (view,), worst = await admin_get(big_agent, "/view/service?name=default/s4999")
    assert states == [ServicePortName("default", "s4999", "http", "TCP")]  # not one per Service (5,000)
    assert view["service"] == "default/s4999" and len(view["modes"]) == len(registry.MODES)
    assert all(f"10.{j + 1}.19.250:8080" in view["modes"][0]["rules"] for j in range(ENDPOINTS))
    assert worst < ADMIN_BOUND


# -- the pieces ---------------------------------------------------------------------------------
ROWS: list[dict[str, Any]] = [{"a": 1, "b": ["x\ny", 2.5, None], "c": {"d": True, "e": []}}, {}, {"f": "é"}]


def test_event_loop_stalls_rows_are_encoded_as_json_dumps() -> None:
    cases: list[list[dict[str, Any]]] = [ROWS, [], [{}], [{"i": i} for i in range(JOIN)]]  # the last in several parts
    for rows in cases:
        assert rows_json(rows) == json.dumps(rows)
        assert b"".join(rows_json_pretty(rows)) == json.dumps(rows, indent=1).encode()
        copy = list(rows)
        assert b"".join(encode_and_free(copy)) == json.dumps(rows, indent=1).encode() + b"\n" and copy == []
    flows: list[dict[str, Any]] = [{"id": i} for i in range(MAX_FLOWS + 7)]
    # any JSON rows: snapshot_json only encodes them
    assert snapshot_json(cast(list[ServiceRow], list(ROWS)), cast(list[FlowRow], list(flows))) == json.dumps(
        {"services": ROWS, "flows": flows[:MAX_FLOWS], "flowCount": MAX_FLOWS + 7}).encode()


def test_event_loop_stalls_an_encoded_event_is_the_event_json() -> None:
    hub = EventHub(clock=lambda: 12.5)
    for data in ({"services": ROWS, "flowCount": 3}, {}):
        ev = hub.publish_encoded("snapshot", json.dumps(data).encode())
        text = b"".join(ev.json_parts())
        assert text == json.dumps({"kind": "snapshot", "at": 12.5, "seq": ev.seq, **data}).encode()
        assert ev.json() == json.loads(text)


def test_event_loop_stalls_a_list_body_is_decoded_as_json_loads() -> None:
    for raw in (b'{}', b' {"items" : [ ] } ', b'{"kind": "List", "items": [{"a": [1, {}]}, 2, "x"],\n "metadata": {}}',
                b'{"items": {"a": 1}}', b'{"a": 1, "a": 2}'):
        assert decode_list(raw, "application/json") == json.loads(raw)
    for raw in (b"", b"<html>", b"{", b'{"items": [1,]}', b'{"items": [1}', b'{"a": 1}x', b'{1: 2}', b"[1]",
                b'{"items": [1] "a": 2}', b"\xff{}"):
        with pytest.raises(SourceError) as err:
            decode_list(raw, "text/html")
        with pytest.raises(SourceError) as want:
            decode_json(raw, "text/html")
        assert str(err.value) == str(want.value)


async def test_event_loop_stalls_one_build_for_every_request_that_waits() -> None:
    release = asyncio.Event()
    started = 0

    async def build() -> int:
        nonlocal started
        started += 1
        await release.wait()
        return started

    shared = SharedBuild(build)
    first = asyncio.create_task(shared.get())
    await asyncio.sleep(0)
    later = [asyncio.create_task(shared.get()) for _ in range(20)]  # arrived while run 1 runs
    await asyncio.sleep(0)
    release.set()
    # Run 1 is older than the later requests: they share run 2, started after they arrived.
    assert await first == 1 and await asyncio.gather(*later) == [2] * 20
    assert shared.runs == 2 and await shared.get() == 3
    assert shared._done is None  # nobody waits: the last result is not kept


# -- a manifest rewritten -----------------------------------------------------------------------
MANIFEST_ENDPOINTS = 20_000


async def test_event_loop_stalls_manifest_reload_of_20_000_endpoints(tmp_path: Path) -> None:
    """The source's part: stat, read, parse, merge and delivery, with the Proxier's syncs held
    (the sync that follows is the next test's)."""
    path = tmp_path / "svc.yaml"
    path.write_text(manifest(MANIFEST_ENDPOINTS))
    a = Agent(ProxyConfig(services=tmp_path, healthz_bind_address="", metrics_bind_address="",
                          min_sync_period=0.05), datapaths=[FakeDatapath("userspace")])
    await a.start()
    try:
        await eventually(lambda: len(a.proxier.endpoints_map.get(WEB, ())) == MANIFEST_ENDPOINTS, timeout=30,
                         what="the first sync")
        source = a.source
        assert isinstance(source, StaticSource)
        with a.proxier.hold_syncs(), WorstGap() as gap:
            path.with_name("new.yaml.tmp").write_text(manifest(MANIFEST_ENDPOINTS).replace("port: 8080", "port: 8081"))
            path.with_name("new.yaml.tmp").rename(path)  # a new inode: read at once
            await eventually(lambda: {e.port for s in source.slices.values() for e in s.endpoints[WEB]} == {8081},
                             timeout=60, what="the rewrite delivered")
        print(f"manifest reload of {MANIFEST_ENDPOINTS} endpoints: worst loop gap {gap.worst * 1000:.1f} ms CPU, "
              f"{gap.worst_wall * 1000:.1f} ms wall")
        assert a.proxier.endpoints_tracker.pending_count() == 1
        await eventually(lambda: {e.port for e in a.proxier.endpoints_map.get(WEB, ())} == {8081}, timeout=30,
                         what="the sync after the hold")
        assert len(a.proxier.endpoints_map[WEB]) == MANIFEST_ENDPOINTS
        assert gap.worst < STALL_BOUND
    finally:
        await a.shutdown()


async def test_event_loop_stalls_sync_of_20_000_changed_endpoints() -> None:
    proxier = Proxier([FakeDatapath("userspace")])
    proxier.on_service_update(None, parse_service(svc("big", "10.96.0.10")))
    slices = [parse_endpoint_slice(raw_slice(i, 8080)) for i in range(MANIFEST_ENDPOINTS // PER_SLICE)]
    for es in slices:
        proxier.on_endpoint_slice_update(None, es)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    await proxier.sync()
    for es in slices:
        proxier.on_endpoint_slice_update(es, parse_endpoint_slice(raw_slice(int(es.name.name[4:]), 8081)))
    with WorstGap() as gap:
        await proxier.sync()
    print(f"sync of {MANIFEST_ENDPOINTS} changed endpoints: worst loop gap {gap.worst * 1000:.1f} ms CPU, "
          f"{gap.worst_wall * 1000:.1f} ms wall")
    big = ServicePortName("default", "big", "http", "TCP")
    assert {e.port for e in proxier.endpoints_map[big]} == {8081}
    assert len(proxier.endpoints_map[big]) == MANIFEST_ENDPOINTS
    assert gap.worst < STALL_BOUND
