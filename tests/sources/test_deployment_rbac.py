"""The shipped RBAC (examples/kubernetes/rbac.yaml, as written) against an API server that enforces
RBAC as kube-apiserver does (tests/sources/fake_rbac.py) and serves ServiceCIDRs.

- The rules: the ServiceAccount may list and watch what the agent reads and nothing else.
- The agent, authenticated as that ServiceAccount (its token), lists and watches Services,
  EndpointSlices, its Node and the ServiceCIDRs without a single 403: a pod reaches a ClusterIP
  and the ServiceCIDR object's CIDR is what the relay blackholes (service_cidr_routes.py).
- With a ClusterRole of before (no servicecidrs), as kube-proxy without that grant: Services are
  served all the same, the 403 is retried with backoff, and the log says once, in one line,
  which grant is missing (no traceback, no line per retry).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns import Topology, inside, nsexec
from tests.offload.harness import Pods, tcp_name, wait_listening
from tests.relay.harness import USPROXY
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text
from tests.sources.fake_rbac import Rbac, service_account_groups, service_account_user
from usproxy.relay.service_cidr_routes import TABLE

RBAC_FILE = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "rbac.yaml"
USER = service_account_user("kube-system", "usproxy")
READS = [("", "services"), ("discovery.k8s.io", "endpointslices"), ("", "nodes"),
         ("networking.k8s.io", "servicecidrs")]


def shipped() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d]


def without_service_cidrs(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ClusterRole as it was before ServiceCIDRs were read."""
    out = copy.deepcopy(objs)
    for o in out:
        if o["kind"] == "ClusterRole":
            o["rules"] = [r for r in o["rules"] if "servicecidrs" not in r["resources"]]
    return out


def test_the_service_account_may_read_what_the_agent_reads_and_nothing_else() -> None:
    rbac = Rbac.from_objects(shipped())
    groups = service_account_groups("kube-system")
    for group, resource in READS:
        for verb in ("list", "watch"):
            assert rbac.denied(USER, groups, group, resource, verb) is None, (resource, verb)
    assert rbac.denied(USER, groups, "", "services", "create") is not None
    assert rbac.denied(USER, groups, "", "secrets", "list") == (
        'secrets is forbidden: User "system:serviceaccount:kube-system:usproxy" cannot list resource "secrets" '
        'in API group "" at the cluster scope')
    other = service_account_user("default", "usproxy")
    assert rbac.denied(other, service_account_groups("default"), "", "services", "list") is not None


def objects() -> list[tuple[str, dict[str, Any]]]:
    svc = {"metadata": {"name": "web", "namespace": "default"},
           "spec": {"type": "ClusterIP", "clusterIP": "10.96.10.10", "clusterIPs": ["10.96.10.10"],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}
    eps = {"metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
           "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": True}, "nodeName": "node-a"}]}
    node = {"metadata": {"name": "node-a", "labels": {}}, "spec": {}}
    cidr = {"metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16"]}}
    return [("services", svc), ("endpointslices", eps), ("nodes", node), ("servicecidrs", cidr)]


@pytest.fixture
async def lab(topology: Topology, tmp_path: Path) -> AsyncIterator[tuple[Topology, Pods, Path]]:
    pods = Pods(topology, tmp_path)
    try:
        pods.add("be", "10.244.1.5")
        topology.add_host("cli", "10.244.9.10")
        yield topology, pods, tmp_path
    finally:
        pods.close()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)


async def run_agent(topo: Topology, tmp: Path, rbac_objects: list[dict[str, Any]]) -> tuple[FakeApiServer, str]:
    """The agent against an RBAC-enforcing server until a pod reached the ClusterIP; its log."""
    token = secrets.token_hex(16)
    api = FakeApiServer(bookmark_interval=0.2, rbac=Rbac.from_objects(rbac_objects),
                        users={token: (USER, service_account_groups("kube-system"))})
    with inside(topo.node):
        await api.start()
    for kind, obj in objects():
        api.apply(kind, obj)
    kc = tmp / "kubeconfig"
    kc.write_text(kubeconfig_text(api.url, token))
    log = tmp / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(["ip", "netns", "exec", topo.node, USPROXY, "run", "--kubeconfig", str(kc),
                                  "--hostname-override", "node-a", "--offload", "none",
                                  "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address",
                                  "127.0.0.1:10249"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        cli = topo.ns("cli")
        wait_listening(cli, "10.244.1.5", 8080)
        while True:
            try:
                if await asyncio.to_thread(tcp_name, cli, "10.96.10.10", 80, 1.0) == "be":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and agent.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        await asyncio.sleep(3.0)  # the ServiceCIDRs' first list, and retries of a 403 (backoff 0.8 s, 1.6 s)
    finally:
        agent.send_signal(signal.SIGTERM)
        await asyncio.to_thread(agent.wait, 15)
        await api.stop()
    assert agent.returncode == 0, log.read_text()[-3000:]
    return api, log.read_text()


@pytest.mark.netns
async def test_the_shipped_rbac_serves_everything(lab: tuple[Topology, Pods, Path]) -> None:
    topo, _, tmp = lab
    api, log = await run_agent(topo, tmp, shipped())
    assert api.denied == [], api.denied
    routes = nsexec(topo.node, "ip", "route", "show", "table", str(TABLE)).stdout
    assert "blackhole 10.96.0.0/16" in routes, (routes, log[-2000:])  # the ServiceCIDR object reached it
    assert "Traceback" not in log and "forbidden" not in log


@pytest.mark.netns
async def test_without_the_service_cidr_grant_services_are_served_and_the_gap_is_named(
        lab: tuple[Topology, Pods, Path]) -> None:
    topo, _, tmp = lab
    api, log = await run_agent(topo, tmp, without_service_cidrs(shipped()))
    assert api.denied and all(d.startswith("servicecidrs.networking.k8s.io is forbidden") for d in api.denied)
    assert len(api.denied) >= 2  # retried, as kube-proxy's informer retries
    lines = [line for line in log.splitlines() if "forbidden" in line]
    assert len(lines) == 1, lines  # said once, not once per retry
    assert "ServiceCIDRs: forbidden (403): this agent's ServiceAccount needs list and watch on servicecidrs" in lines[0]
    assert "Traceback" not in log
