"""Real traffic with the Kubernetes source: `usproxy run --kubeconfig` in a node netns, the (fake)
API server reachable there, a pod and a client in their own netns. Changes on the server reach
traffic within 1 s, and while the API server is down the relay keeps serving the last known state
(nothing is flushed), then follows the server again once it is back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import USPROXY, Backends
from tests.relay.tcp_clients import ask_in
from tests.sources.conftest import eps, svc
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

pytestmark = pytest.mark.netns


def admin(node: str, path: str, port: int = 10249) -> Any:
    with inside(node), urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
        return json.load(r)


async def until(pred: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if pred():
                return time.monotonic() - start
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_api_changes_reach_traffic_and_an_outage_flushes_nothing(topology: Topology, tmp_path: Path) -> None:
    backends = Backends(topology)
    for i in (1, 2):
        ns = topology.add_host(f"be{i}", f"10.244.{i}.5")
        backends.start(ns, "idsrv", f"be{i}", f"10.244.{i}.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    api = FakeApiServer(bookmark_interval=0.2)
    with inside(topology.node):  # the server's socket lives where the agent can reach it
        await api.start()
    api.apply("services", svc("web", "10.96.10.10"))
    api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5"]))
    kc = tmp_path / "kubeconfig"
    kc.write_text(kubeconfig_text(api.url, api.token))
    log = (tmp_path / "agent.log").open("ab")
    agent = subprocess.Popen(
        ["ip", "netns", "exec", topology.node, USPROXY, "-v", "run", "--kubeconfig", str(kc),
         "--hostname-override", "node-a", "--offload", "none",
         "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        await until(lambda: ask_in(cli, "10.96.10.10", 80) == "be1", 10, "first sync")
        api.apply("endpointslices", eps("web-1", "web", ["10.244.2.5"]))
        took = await until(lambda: ask_in(cli, "10.96.10.10", 80) == "be2", 3, "endpoint change")
        assert took < 1.0
        before = admin(topology.node, "/services")
        await api.stop()
        for _ in range(20):  # about 2 s of outage: traffic keeps flowing, nothing withdrawn
            assert ask_in(cli, "10.96.10.10", 80) == "be2"
            await asyncio.sleep(0.1)
        assert admin(topology.node, "/services") == before
        with inside(topology.node):
            await api.start()
        api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5"]))
        await until(lambda: ask_in(cli, "10.96.10.10", 80) == "be1", 35, "convergence after the outage")
        assert agent.poll() is None
    finally:
        agent.terminate()
        agent.wait(10)
        log.close()
        await api.stop()
        backends.close()
