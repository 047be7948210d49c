"""Three nodes, one API server (issue 13 item 10): each node netns runs an agent (`--kubeconfig`,
nftables offload) on the same Services, a pod on each node, and an external client.

Layout: netns "lan" holds bridge lan0 with 192.0.2.1/24 (the fake API server listens there) and
203.0.113.1/24 (the gateway of netns "ext", 203.0.113.2); node i (1..3) has eth0 192.0.2.1i/24 on
lan0, its pod network 10.244.i.0/24 on its own bridge, routes to the other nodes' pod networks
and a default route via lan. Pod i (10.244.i.10) answers on port 80 with its address and the peer
it saw (endpoint_server.py).

Services: `web` (NodePort 31080, externalTrafficPolicy Cluster, endpoints on every node) and
`local` (LoadBalancer, externalTrafficPolicy Local, NodePort 31081, healthCheckNodePort 32081,
endpoints on nodes 1 and 2 only). Expectations, as kube-proxy: every node serves both NodePorts;
eTP=Local keeps the client's address and answers only from the node's own endpoint; a node
without one drops (item 6, pending) and its health check port says 503 where the others say 200
(item 3, pending); one agent restarting leaves every node serving, its own included (the kernel
keeps the table while no agent runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.probe import Attempt, Spec, run
from tests.netns import Topology, inside, nsexec, sh
from tests.relay.harness import USPROXY
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

pytestmark = pytest.mark.netns

NODES = (1, 2, 3)
EXT = "203.0.113.2"
WEB, LOCAL, HEALTH = 31080, 31081, 32081


def node_ip(i: int) -> str:
    return f"192.0.2.1{i}"


def pod_ip(i: int) -> str:
    return f"10.244.{i}.10"


def objects() -> list[tuple[str, dict[str, Any]]]:
    def service(name: str, ip: str, port: dict[str, Any], **spec: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                                     "targetPort": 80, **port}], **spec}}

    def slice_(name: str, nodes: tuple[int, ...]) -> dict[str, Any]:
        return {"metadata": {"name": f"{name}-1", "namespace": "default",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
                "endpoints": [{"addresses": [pod_ip(i)], "conditions": {"ready": True}, "nodeName": f"node-{i}"}
                              for i in nodes]}

    return [("nodes", {"metadata": {"name": f"node-{i}", "labels": {"kubernetes.io/hostname": f"node-{i}"}}})
            for i in NODES] + [
        ("services", service("web", "10.96.0.80", {"nodePort": WEB}, type="NodePort")),
        ("services", service("local", "10.96.0.81", {"nodePort": LOCAL}, type="LoadBalancer",
                             externalTrafficPolicy="Local", healthCheckNodePort=HEALTH)),
        ("endpointslices", slice_("web", NODES)),
        ("endpointslices", slice_("local", (1, 2)))]


class ApiThread:
    """The fake API server on its own event loop, in a thread that lives in netns `ns`."""

    def __init__(self, ns: str, host: str) -> None:
        self.api = FakeApiServer(bookmark_interval=0.2, host=host)
        self.loop = asyncio.new_event_loop()
        self._ns = ns
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.call(self.api.start())

    def _run(self) -> None:
        with inside(self._ns):  # the listening socket is made by this thread: it belongs to `ns`
            asyncio.set_event_loop(self.loop)
            self.loop.run_forever()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def apply(self, resource: str, obj: dict[str, Any]) -> None:
        async def do() -> None:
            self.api.apply(resource, obj)
        self.call(do())

    def close(self) -> None:
        self.call(self.api.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.topo = Topology()
        self.lan, self.ext = self.topo.ns("lan"), self.topo.ns("ext")
        self.nodes = {i: self.topo.ns(f"n{i}") for i in NODES}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.api: ApiThread | None = None

    def _ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.topo.namespaces.append(name)
        nsexec(name, "ip", "link", "set", "lo", "up")

    def _veth(self, outer_ns: str, outer: str, inner_ns: str, master: str) -> None:
        nsexec(outer_ns, "ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", inner_ns)
        nsexec(outer_ns, "ip", "link", "set", outer, "master", master, "up")
        nsexec(inner_ns, "ip", "link", "set", "eth0", "up")

    def build(self) -> None:
        tag = self.topo.prefix[-6:]
        self._ns(self.lan)
        nsexec(self.lan, "ip", "link", "add", "lan0", "type", "bridge")
        for a in ("192.0.2.1/24", "203.0.113.1/24"):
            nsexec(self.lan, "ip", "addr", "add", a, "dev", "lan0")
        nsexec(self.lan, "ip", "link", "set", "lan0", "up")
        nsexec(self.lan, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._ns(self.ext)
        self._veth(self.lan, f"{tag}x", self.ext, "lan0")
        nsexec(self.ext, "ip", "addr", "add", f"{EXT}/24", "dev", "eth0")
        nsexec(self.ext, "ip", "route", "add", "default", "via", "203.0.113.1")
        for i, n in self.nodes.items():
            self._ns(n)
            self._veth(self.lan, f"{tag}n{i}", n, "lan0")
            nsexec(n, "ip", "addr", "add", f"{node_ip(i)}/24", "dev", "eth0")
            nsexec(n, "ip", "link", "add", "usbr0", "type", "bridge")
            nsexec(n, "ip", "addr", "add", f"10.244.{i}.1/24", "dev", "usbr0")
            nsexec(n, "ip", "link", "set", "usbr0", "up")
            nsexec(n, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            nsexec(n, "ip", "route", "add", "default", "via", "192.0.2.1")
            nsexec(self.lan, "ip", "route", "add", f"10.244.{i}.0/24", "via", node_ip(i))
            for j in NODES:
                if j != i:
                    nsexec(n, "ip", "route", "add", f"10.244.{j}.0/24", "via", node_ip(j))
            pod = self.topo.ns(f"pod{i}")
            self._ns(pod)
            self._veth(n, f"{tag}p{i}", pod, "usbr0")
            nsexec(pod, "ip", "addr", "add", f"{pod_ip(i)}/24", "dev", "eth0")
            nsexec(pod, "ip", "route", "add", "default", "via", f"10.244.{i}.1")
            p = subprocess.Popen(["ip", "netns", "exec", pod, sys.executable,
                                  str(Path(__file__).with_name("endpoint_server.py")), pod_ip(i), "80"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.procs.append(p)
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        self.api = ApiThread(self.lan, "192.0.2.1")
        for resource, obj in objects():
            self.api.apply(resource, obj)
        (self.tmp / "kubeconfig").write_text(kubeconfig_text(self.api.api.url))
        for i in NODES:
            self.start_agent(i)
        for i in NODES:
            self.wait_offloaded(i)

    def start_agent(self, i: int) -> None:
        with (self.tmp / f"agent-{i}.log").open("ab") as log:
            self.agents[i] = subprocess.Popen(
                ["ip", "netns", "exec", self.nodes[i], USPROXY, "-v", "run", "--kubeconfig", str(self.tmp / "kubeconfig"),
                 "--hostname-override", f"node-{i}", "--nodeport-addresses", "192.0.2.0/24",
                 "--offload", "nftables", "--offload-after", "1", "--min-sync-period", "200ms",
                 "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def stop_agent(self, i: int) -> None:
        p = self.agents.pop(i)
        p.terminate()
        p.wait(15)

    def wait_offloaded(self, i: int, timeout: float = 20.0) -> None:
        deadline, rows = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                with inside(self.nodes[i]), urllib.request.urlopen("http://127.0.0.1:10249/services", timeout=2) as r:
                    rows = json.load(r)
                if len(rows) == 2 and all(r["datapath"] == "nftables" for r in rows):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        log = (self.tmp / f"agent-{i}.log").read_text()[-2000:]
        raise AssertionError(f"node {i} never offloaded both Services: {rows}\n{log}")

    def probe(self, spec: Spec) -> list[Attempt]:
        with inside(self.ext):
            return run(spec)

    def close(self) -> None:
        for i in list(self.agents):
            self.agents[i].kill()
            self.agents[i].wait()
        for p in self.procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        if self.api is not None:
            self.api.close()
        self.topo.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("multi-node"))
    try:
        c.build()
        yield c
    finally:
        c.close()


def test_every_node_serves_the_nodeport(cluster: Cluster) -> None:
    for i in NODES:
        got = cluster.probe(Spec("tcp", EXT, node_ip(i), WEB, 30, 2.0))
        assert [a.error for a in got if a.error] == [], i
        assert {a.endpoint for a in got} == {f"{pod_ip(j)}:80" for j in NODES}, i
        # externalTrafficPolicy Cluster: masqueraded to the receiving node (its address on the way out)
        assert {a.peer for a in got} <= {node_ip(i), f"10.244.{i}.1"}, (i, {a.peer for a in got})


def test_local_policy_keeps_the_client_address_and_the_local_endpoint(cluster: Cluster) -> None:
    for i in (1, 2):
        got = cluster.probe(Spec("tcp", EXT, node_ip(i), LOCAL, 20, 2.0))
        assert {(a.endpoint, a.peer, a.error) for a in got} == {(f"{pod_ip(i)}:80", EXT, "")}, i


@pytest.mark.xfail(strict=True, reason="DROP for no local endpoints (issue 13 item 6)")
def test_local_policy_without_a_local_endpoint_drops(cluster: Cluster) -> None:
    got = cluster.probe(Spec("tcp", EXT, node_ip(3), LOCAL, 1, 1.0))
    assert [a.error for a in got] == ["timeout"]


@pytest.mark.xfail(strict=True, reason="healthCheckNodePort (issue 13 item 3)")
def test_health_check_port_answers_where_endpoints_are_local(cluster: Cluster) -> None:
    status = {i: [a.endpoint or a.error for a in cluster.probe(Spec("http", EXT, node_ip(i), HEALTH, 1, 2.0))]
              for i in NODES}
    assert {i: s[0].split()[1] if s[0].startswith("HTTP/") else s[0] for i, s in status.items()} == \
        {1: "200", 2: "200", 3: "503"}, status


def test_an_agent_restart_leaves_every_node_serving(cluster: Cluster) -> None:
    failures: list[tuple[int, str]] = []
    answers = {i: 0 for i in NODES}
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for i in NODES:
                for a in cluster.probe(Spec("tcp", EXT, node_ip(i), WEB, 1, 2.0)):
                    if a.error:
                        failures.append((i, a.error))
                    else:
                        answers[i] += 1
            time.sleep(0.01)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        cluster.stop_agent(2)
        time.sleep(1.5)  # node 2 has no agent: its table keeps serving, nodes 1 and 3 are untouched
        during = dict(answers)
        cluster.start_agent(2)
        cluster.wait_offloaded(2)
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(10)
    assert failures == []
    assert all(n > 20 for n in during.values()), during
    assert all(answers[i] > during[i] for i in NODES), (during, answers)
