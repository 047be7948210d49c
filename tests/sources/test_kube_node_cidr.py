"""detectLocalMode NodeCIDR against the fake API server, as kube-proxy
(cmd/kube-proxy/app/server_linux.go waitForPodCIDR, pkg/proxy/node.go NodeManager): the agent
waits for its Node to have spec.podCIDRs (a Node being deleted does not count) and builds the
detector from them; it gives up after the timeout with an error naming the Node and the mode;
a later change of the podCIDRs stops the agent with exit code 1, to be restarted, while a version
whose podCIDRs do not parse is logged and changes nothing."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.sources.conftest import FAST, Recorder, eventually, eps, node, svc
from tests.sources.fake_apiserver import FakeApiServer
from usproxy.app.agent import Agent, node_facts
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import FakeDatapath
from usproxy.util.errors import SourceError
from usproxy.model.node import PodCIDRsChanged
from usproxy.sources.kube import KubeSource, wait_for_pod_cidrs

POD_V4 = ipaddress.ip_network("10.244.1.0/24")


def with_pod_cidrs(name: str, cidrs: list[str], **meta: Any) -> dict[str, Any]:
    n = node(name)
    return {**n, "metadata": {**n["metadata"], **meta}, "spec": {"podCIDR": cidrs[0] if cidrs else "",
                                                                "podCIDRs": cidrs}}


async def test_waits_for_the_pod_cidrs_then_builds_the_detector(
        api: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    api.apply("nodes", node("node-a"))  # registered, no pod CIDR allocated yet
    cfg = ProxyConfig(kubeconfig=kubeconfig, hostname_override="node-a", detect_local_mode="NodeCIDR")
    waiting = asyncio.create_task(node_facts(cfg))
    await eventually(lambda: "waiting for Node node-a to have spec.podCIDRs" in caplog.text, what="the wait logged")
    await asyncio.sleep(0.3)
    assert not waiting.done()
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.1.0/24", "fd00:10:244:1::/64"], deletionTimestamp="x"))
    await asyncio.sleep(1.3)  # a Node being deleted does not count (kube-proxy keeps waiting)
    assert not waiting.done()
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.1.0/24", "fd00:10:244:1::/64"]))
    facts = await asyncio.wait_for(waiting, 3.0)
    assert facts.pod_cidrs == (POD_V4, ipaddress.ip_network("fd00:10:244:1::/64"))
    assert facts.detector.if_not_local_nft(4) == "ip saddr != 10.244.1.0/24"  # not --cluster-cidr
    assert facts.detector.if_local_nft(6) == "ip6 saddr fd00:10:244:1::/64"


async def test_gives_up_after_the_timeout_naming_the_node(api: FakeApiServer, kubeconfig: Path) -> None:
    api.apply("nodes", node("node-a"))
    cfg = ProxyConfig(kubeconfig=kubeconfig)
    with pytest.raises(SourceError, match=r"timeout waiting for Node node-a to have spec.podCIDRs, needed by "
                                          r"detectLocalMode NodeCIDR .*: it has no spec.podCIDRs yet"):
        await wait_for_pod_cidrs(cfg, "node-a", timeout=0.3, interval=0.05, options=FAST)
    with pytest.raises(SourceError, match="no such Node"):
        await wait_for_pod_cidrs(cfg, "node-z", timeout=0.1, interval=0.05, options=FAST)


async def test_a_change_of_the_pod_cidrs_ends_the_source(api: FakeApiServer, kubeconfig: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.1.0/24"]))
    rec = Recorder()
    source = KubeSource(ProxyConfig(kubeconfig=kubeconfig), rec, node_name="node-a", options=FAST,
                        node_wait=1.0, pod_cidrs=(POD_V4,))
    task = asyncio.create_task(source.run())
    api.apply("nodes", {**with_pod_cidrs("node-a", ["010.244.1.0/24"]),  # the same CIDR, written sloppily
                        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z"}}})
    await eventually(lambda: rec.zone == "z", what="an update with the same pod CIDRs taken")
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.1.0/24", "10.244.1.0/99"]))  # invalid: logged only
    await eventually(lambda: "spec.podCIDRs[1]: not a CIDR" in caplog.text, what="the bad version logged")
    await asyncio.sleep(0.2)
    assert not task.done()
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.7.0/24"]))
    with pytest.raises(PodCIDRsChanged, match=r"Node node-a: spec.podCIDRs changed from 10.244.1.0/24 to "
                                              r"10.244.7.0/24; .* exiting to be restarted"):
        await asyncio.wait_for(task, 3.0)


async def test_the_agent_exits_with_1_when_the_pod_cidrs_change(api: FakeApiServer, kubeconfig: Path) -> None:
    api.apply("nodes", with_pod_cidrs("node-a", ["10.244.1.0/24"]))
    api.apply("services", svc("web", "10.96.0.10"))
    api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5"]))
    cfg = ProxyConfig(kubeconfig=kubeconfig, hostname_override="node-a", detect_local_mode="NodeCIDR",
                      healthz_bind_address="127.0.0.1:0", metrics_bind_address="127.0.0.1:0")
    dp = FakeDatapath("userspace")
    agent = Agent(cfg, datapaths=[dp], node=await node_facts(cfg))
    run = asyncio.create_task(agent.run())
    try:
        await eventually(lambda: "10.96.0.10:80 -> 10.244.1.5:8080" in dp.dump(), what="served")
        assert agent.exit_code == 0 and not run.done()
        api.delete("nodes", "node-a")  # re-created without its pod CIDR: as kube-proxy, a change
        api.apply("nodes", node("node-a"))
        await asyncio.wait_for(run, 5.0)
        assert agent.exit_code == 1
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
