"""healthCheckNodePort through the real agent in a network namespace (both event loops; with the
relay alone and with the nftables datapath serving the Service): an
externalTrafficPolicy Local LoadBalancer answers 200 with localEndpoints 1 on every node address
while its endpoint is on this node, 503 once the manifest moves it to another node, and the port
closes when the Service goes; probes keep answering quickly while the relay carries many
connections and the agent syncs hundreds of Services, and /healthz keeps its own semantics."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside
from tests.offload.harness import OFFLOAD
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc

pytestmark = pytest.mark.netns

HC_PORT = 30999
NODE = "node1"


def lb(**spec: Any) -> dict[str, Any]:
    body = svc("lb", "10.96.30.1", [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
               type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=HC_PORT, **spec)
    body["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.5"}]}}
    return body


def endpoint_on(node: str) -> dict[str, Any]:
    return slice_("lb", [{"ip": "10.244.1.5", "ready": True, "nodeName": node}],
                  [{"name": "http", "port": 8080, "protocol": "TCP"}])


def probe(ns: str, addr: str, timeout: float = 3.0) -> tuple[int, dict[str, str], Any]:
    """GET an arbitrary path of the health check port from netns `ns`."""
    with inside(ns):
        try:
            with urllib.request.urlopen(f"http://{addr}:{HC_PORT}/any/path", timeout=timeout) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())


def wait_status(ns: str, addr: str, status: int, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    seen: Any = None
    while time.monotonic() < deadline:
        try:
            seen = probe(ns, addr)
            if seen[0] == status:
                return seen[2]
        except OSError as err:
            seen = err
        time.sleep(0.05)
    raise AssertionError(f"no {status} from {addr}:{HC_PORT} in {timeout}s; last {seen!r}")


def closed(ns: str, addr: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with inside(ns):
            try:
                socket.create_connection((addr, HC_PORT), timeout=1).close()
            except ConnectionRefusedError:
                return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("datapath", [(), OFFLOAD], ids=["relay", "nftables"])
def test_health_check_follows_local_endpoints_and_the_service(
        topology: Topology, backends: Backends, workdir: Path, loop_name: str, datapath: tuple[str, ...]) -> None:
    be = topology.add_host("be1", "10.244.1.5")
    backends.start(be, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(lb(), endpoint_on(NODE))
    agent = AgentProc(topology, m, loop_name, "--hostname-override", NODE, *datapath)
    try:
        agent.start()
        if datapath:
            wait_offloaded(agent)
        for addr in topology.node_addresses:  # no --nodeport-addresses: every address
            status, headers, body = probe(cli, addr)
            assert status == 200 and body == {"service": {"namespace": "default", "name": "lb"},
                                              "localEndpoints": 1, "serviceProxyHealthy": True}
            assert headers["X-Load-Balancing-Endpoint-Weight"] == "1"
        row = agent.services()[0]
        assert (row["healthCheckNodePort"], row["healthCheckError"]) == (HC_PORT, None)
        m.write(lb(), endpoint_on("node2"))
        body = wait_status(cli, "192.0.2.10", 503)
        assert body["localEndpoints"] == 0 and body["serviceProxyHealthy"] is True
        assert agent.get("/healthz", port=10256)["nodeEligible"] is True  # /healthz is unaffected
        m.write(lb(), endpoint_on(NODE))
        assert wait_status(cli, "192.0.2.11", 200)["localEndpoints"] == 1
        m.write(endpoint_on(NODE))
        assert closed(cli, "192.0.2.10") and closed(cli, "192.0.2.11")
    finally:
        assert agent.stop() == 0


def wait_offloaded(agent: AgentProc, timeout: float = 10.0) -> None:
    """Until the nftables datapath serves the Service (its own rules, not the relay's socket)."""
    deadline = time.monotonic() + timeout
    while agent.services()[0]["datapath"] != "nftables":
        assert time.monotonic() < deadline, agent.services()[0]
        time.sleep(0.1)


def many_services(n: int, port: int) -> list[dict[str, Any]]:
    return [svc(f"s{i}", f"10.96.{40 + i // 250}.{1 + i % 250}", [{"name": "p", "port": port, "targetPort": 8080}])
            for i in range(n)]


def hold_connections(ns: str, n: int, stop: threading.Event) -> list[socket.socket]:
    """`n` relayed connections through the NodePort, each echoing 64 KiB until `stop`."""
    socks = []
    with inside(ns):
        for _ in range(n):
            s = socket.create_connection(("192.0.2.10", 30080), timeout=5)
            s.makefile().readline()
            socks.append(s)

    def pump(s: socket.socket) -> None:
        chunk = b"x" * 65536
        try:
            while not stop.is_set():
                s.sendall(chunk)
                got = 0
                while got < len(chunk):
                    got += len(s.recv(65536))
        except OSError:
            pass  # closed by the test's cleanup
    for s in socks:
        threading.Thread(target=pump, args=(s,), daemon=True).start()
    return socks


def test_health_check_answers_while_the_relay_is_loaded_and_syncs_run(
        topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    be = topology.add_host("be1", "10.244.1.5")
    backends.start(be, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(lb(), endpoint_on(NODE))
    agent = AgentProc(topology, m, loop_name, "--hostname-override", NODE)
    stop = threading.Event()
    socks: list[socket.socket] = []
    latencies: list[float] = []
    failures: list[BaseException] = []

    def prober() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                status, _, body = probe(cli, "192.0.2.10", timeout=5)
                assert status == 200 and body["localEndpoints"] == 1
            except BaseException as err:  # reported below: a thread cannot fail the test itself
                failures.append(err)
            latencies.append(time.monotonic() - start)
    try:
        agent.start()
        socks = hold_connections(cli, 100, stop)
        probers = [threading.Thread(target=prober) for _ in range(8)]  # within one Service's share
        for t in probers:
            t.start()
        # each rewrite re-syncs 300 ServicePorts (listeners and addresses): about 1 s here, longer
        # than any probe may take
        for round_ in range(3):
            agent.wait_synced_after(m.write(lb(), endpoint_on(NODE), *many_services(300, 81 + round_)),
                                    timeout=60)
        stop.set()
        for t in probers:
            t.join(10)
        assert not failures, failures[:3]
        assert len(latencies) >= 50 and max(latencies) < 1.0, (len(latencies), max(latencies))
    finally:
        stop.set()
        for s in socks:
            s.close()
        assert agent.stop() == 0
