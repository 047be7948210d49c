"""`usproxy run --kubeconfig FILE` end to end against the fake API server.

The agent is built from the real command line (cli.build_parser, config_from_args) with its default
reflector timings, and a FakeDatapath("userspace") standing in for the relay. Covered: the listed
Services are served, changes arrive within 1 s, /healthz stays 200 while the API server is gone
and nothing is withdrawn, and the state converges after the server comes back;
`clientConnection.kubeconfig` of a KubeProxyConfiguration file reaches the source too; without
--hostname-override or NODE_NAME the hostname names the node for the Proxier, every datapath and
the source alike.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.sources.conftest import eps, eventually, svc
from tests.sources.fake_apiserver import FakeApiServer
from usproxy.app.agent import Agent
from usproxy.app.cli import build_parser, config_from_args
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import FakeDatapath
from usproxy.offload.manager import OffloadManager
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.relay.relay import Relay
from usproxy.sources.kube import KubeSource

LOOPBACK = ["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]


async def start_agent(argv: list[str]) -> tuple[Agent, FakeDatapath]:
    cfg = config_from_args(build_parser().parse_args(["run", *argv, *LOOPBACK]))
    dp = FakeDatapath("userspace")
    agent = Agent(cfg, datapaths=[dp])
    await agent.start()
    return agent, dp


@pytest.fixture
async def agent(api: FakeApiServer, kubeconfig: Path) -> AsyncIterator[tuple[Agent, FakeDatapath]]:
    api.apply("services", svc("web", "10.96.0.10"))
    api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5", "10.244.2.7"]))
    a, dp = await start_agent(["--kubeconfig", str(kubeconfig), "--hostname-override", "node-a"])
    try:
        yield a, dp
    finally:
        await a.shutdown()


async def healthz(a: Agent) -> int:
    host, port = a.admin.bound["healthz"]
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/healthz") as resp:
        return resp.status


async def test_serves_listed_services_and_follows_changes_within_a_second(
        api: FakeApiServer, agent: tuple[Agent, FakeDatapath]) -> None:
    a, dp = agent
    await eventually(lambda: "10.96.0.10:80 -> 10.244.1.5:8080 10.244.2.7:8080" in dp.dump(), what="listed state")
    assert a.proxier.node.name == "node-a"
    await asyncio.sleep(1.2)  # let the sync runner's burst refill, as in a quiet cluster
    t0 = time.monotonic()
    api.apply("services", svc("api", "10.96.0.20", port=443))
    api.apply("endpointslices", eps("api-1", "api", ["10.244.3.3"], port=8443))
    await eventually(lambda: "10.96.0.20:443 -> 10.244.3.3:8443" in dp.dump(), timeout=1.0, what="add within 1 s")
    api.apply("endpointslices", eps("web-1", "web", ["10.244.2.7"]))
    api.delete("services", "api")
    await eventually(lambda: "10.244.1.5" not in dp.dump() and "10.96.0.20" not in dp.dump(), timeout=1.0,
                     what="update and delete within 1 s")
    assert time.monotonic() - t0 < 2.0
    views = {row["servicePortName"]: row for row in await a.services()}
    assert list(views) == ["default/web:http"] and views["default/web:http"]["datapath"] == "userspace"


async def test_api_server_outage_keeps_traffic_and_health(api: FakeApiServer,
                                                          agent: tuple[Agent, FakeDatapath]) -> None:
    a, dp = agent
    await eventually(lambda: "10.244.2.7" in dp.dump(), what="listed state")
    served = dp.dump()
    await api.stop()
    await asyncio.sleep(2.0)  # default backoff: 0.8 s, then 1.6 s
    assert dp.dump() == served and await healthz(a) == 200
    assert a.proxier.initialized
    api.apply("endpointslices", eps("web-1", "web", ["10.244.9.9"]))
    await api.restart()
    await eventually(lambda: "10.244.9.9" in dp.dump(), timeout=8.0, what="converged after the outage")
    assert await healthz(a) == 200


async def test_kubeconfig_from_kube_proxy_configuration(api: FakeApiServer, kubeconfig: Path, tmp_path: Path) -> None:
    conf = tmp_path / "kube-proxy.yaml"
    conf.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                    f"clientConnection:\n  kubeconfig: {kubeconfig}\nhostnameOverride: node-b\n")
    api.apply("services", svc("dns", "10.96.0.53", port=53))
    a, dp = await start_agent(["--config", str(conf)])
    try:
        await eventually(lambda: "10.96.0.53:53" in dp.dump(), what="state through the config file")
        assert a.proxier.node.name == "node-b"
        assert isinstance(a._make_source(), KubeSource)
    finally:
        await a.shutdown()


async def test_without_override_the_hostname_names_the_node_everywhere(kubeconfig: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Kubernetes mode, no --hostname-override, no NODE_NAME: the Proxier, the relay, the nftables
    datapath and the source all use the hostname (the nftables datapath used to get None and
    treated every endpoint as possibly local)."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    a = Agent(ProxyConfig(kubeconfig=kubeconfig, offload="nftables"))
    try:
        host = socket.gethostname().lower()
        relay, manager = a.datapaths
        assert isinstance(relay, Relay) and isinstance(manager, OffloadManager)
        nft = [k for k in manager.kernels if isinstance(k, NftablesDatapath)]
        assert len(nft) == 1
        names = {"agent": a.node.name, "proxier": a.proxier.node.name, "relay": relay.node.name,
                 "nftables": nft[0].node.name}
        assert names == dict.fromkeys(names, host)
        source = a._make_source()
        assert isinstance(source, KubeSource) and source.node_name == host
    finally:
        await a.proxier.close()
