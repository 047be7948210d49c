"""Class "event-loop stalls" (issue 18, item 4): /services was quadratic in endpoints (a tuple
scan per endpoint: 10,000 endpoints froze the relay 8.8 s) and /flows built 9,800 rows in one
piece on the loop. The view is computed from sets (counted: no endpoint comparison grows with
the endpoint count), and both views are built in chunks with the loop running in between
(counted: the loop gets a turn every VIEW_CHUNK rows). No timed assertion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from usproxy.app.agent import VIEW_CHUNK, Agent
from usproxy.config import ProxyConfig
from usproxy.conntrack.flow_table import Flow, FlowTable
from usproxy.datapath import FakeDatapath
from usproxy.endpoint import Endpoint
from usproxy.types import ServicePortName

N = 2000
WEB = ServicePortName("default", "web", "http", "TCP")


def manifest(n: int) -> str:
    eps = ",".join(f"{{addresses: [10.1.{i // 256}.{i % 256}]}}" for i in range(n))
    return f"""apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec: {{clusterIP: 10.96.10.10, ports: [{{name: http, port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{eps}]
"""


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
    rows = agent.services_view()
    assert len(rows[0]["endpoints"]) == N and all(e["usable"] for e in rows[0]["endpoints"])
    assert compared < N  # a tuple scan per endpoint made ~N*N/2 = 2,000,000 comparisons


async def test_event_loop_stalls_services_yields_every_chunk(agent: Agent) -> None:
    rows, ticks = await ticks_during(agent.services())
    assert rows == agent.services_view()
    assert ticks >= N // VIEW_CHUNK


class ChunkedRelay:
    """The relay's /flows surface over a real FlowTable."""

    def __init__(self, table: FlowTable) -> None:
        self.table = table

    def flows_chunks(self, size: int) -> Iterator[list[dict[str, Any]]]:
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
