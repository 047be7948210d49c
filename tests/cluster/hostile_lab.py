"""The three-node cluster of cluster.py set up for the hostile-network tests (issue 29): pods that
run both idsrv (TCP/UDP 8080: name and peer, UDP answers) and pushsrv (TCP 8081: server pushes and
downloads), Services over them, and one agent per node in the datapath under test:

  "nftables"  `--offload nftables` (the control run: what kube-proxy's datapath does)
  "snat"      `--offload bpf`, NodePorts at tc with SNAT
  "dsr"       `--offload bpf --bpf-lb-mode dsr`
  "xdp"       `--offload bpf --bpf-lb-acceleration native` on n1, with an XDP program on the lan
              side of n1's eth0 and complete checksums from every sender (test_xdp_maglev.py says why)

Services (ClusterIPs 10.96.29.x): "push" (TCP NodePort PUSH_NP, port 80 -> 8081) and "id" (TCP
NodePort ID_NP, port 80 -> 8080) and "dns" (UDP NodePort UDP_NP, port 53 -> 8080), each over the
pods the test names. A pod named with the node it runs on: push-b on n2 is 10.244.2.10.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from tests.cluster.cluster import LAN, Cluster
from tests.cluster.bpf_agents import Agents, node_dirs, served_by_bpf
from tests.cluster.test_three_nodes import AGENT_FLAGS, offloaded
from tests.cluster.workload import service, slice_of, udp_service, udp_slice
from tests.netns import inside

PUSH_NP, ID_NP, UDP_NP = 30290, 30291, 30292
PUSHSRV = str(Path(__file__).with_name("pushsrv.py"))
MODES = ("nftables", "snat", "dsr", "xdp")


class ModeAgents(Agents):
    def __init__(self, c: Cluster, kc: Path, dirs: dict[int, tuple[Path, Path]], mode: str) -> None:
        super().__init__(c, kc, dirs)
        self.mode = mode

    def flags(self, i: int) -> tuple[str, ...]:
        extra = {"dsr": ("--bpf-lb-mode", "dsr"),
                 "xdp": ("--bpf-lb-acceleration", "native" if i == 1 else "disabled")}.get(self.mode, ())
        return (*super().flags(i), *extra)

    def start(self, i: int) -> None:
        if self.mode == "nftables":
            self.c.start_agent(i, self.kc, *AGENT_FLAGS)
        else:
            super().start(i)

    async def settled(self, nodes: Iterable[int] = (1, 2, 3)) -> None:
        for i in nodes:
            if self.mode == "nftables":
                await offloaded(self.c, range(i, i + 1))
            else:
                await served_by_bpf(self.c, range(i, i + 1))


def pod_ip(name: str) -> str:
    """push-b -> 10.244.2.10, push-b2 -> 10.244.2.11: the node from the letter, then the index."""
    node = "abc".index(name.split("-")[1][0]) + 1
    index = int(name.split("-")[1][1:] or "0")
    return f"10.244.{node}.{10 + index}"


def pod_node(name: str) -> int:
    return int(pod_ip(name).split(".")[2])


def add_pod(c: Cluster, name: str) -> str:
    """A pod netns running idsrv on 8080 and pushsrv on 8081."""
    ns = c.add_pod(pod_node(name), name, pod_ip(name))
    c.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, PUSHSRV, name, "8081"],
                                    stdin=subprocess.DEVNULL))
    return ns


def push_service(pods: list[str]) -> list[tuple[str, dict[str, Any]]]:
    svc = service("push", "10.96.29.10", PUSH_NP, "Cluster")
    svc["spec"]["ports"][0]["targetPort"] = 8081
    eps = slice_of("push", [(pod_ip(p), pod_node(p)) for p in pods])
    eps["ports"][0]["port"] = 8081
    return [("services", svc), ("endpointslices", eps)]


def id_service(pods: list[str]) -> list[tuple[str, dict[str, Any]]]:
    return [("services", service("id", "10.96.29.11", ID_NP, "Cluster")),
            ("endpointslices", slice_of("id", [(pod_ip(p), pod_node(p)) for p in pods]))]


def dns_service(pods: list[str]) -> list[tuple[str, dict[str, Any]]]:
    return [("services", udp_service("dns", "10.96.29.12", UDP_NP)),
            ("endpointslices", udp_slice("dns", [(pod_ip(p), pod_node(p)) for p in pods]))]


@contextlib.asynccontextmanager
async def hostile_lab(tmp_path: Path, mode: str, pods: list[str],
                      objects: list[tuple[str, dict[str, Any]]]) -> AsyncIterator[tuple[Cluster, ModeAgents]]:
    """The cluster with `pods` and `objects` (resource, object) and agents in `mode`, settled."""
    from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

    c = Cluster(tmp_path)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    with node_dirs(secrets.token_hex(3)) as dirs:
        try:
            c.build()
            if mode == "xdp":
                c.uplink_xdp(1)
                c.wire_checksums(c.ns("ext"))
            for name in pods:
                ns = add_pod(c, name)
                if mode == "xdp":
                    c.wire_checksums(ns)
            with inside(c.ns("lan")):
                await api.start()
            for resource, obj in objects:
                api.apply(resource, obj)
            kc = tmp_path / "kubeconfig"
            kc.write_text(kubeconfig_text(api.url))
            agents = ModeAgents(c, kc, dirs, mode)
            for i in (1, 2, 3):
                await asyncio.to_thread(agents.start, i)
            await agents.settled()
            await asyncio.to_thread(wait_listening, c, pods)
            yield c, agents
        finally:
            await asyncio.to_thread(c.close)
            await api.stop()


def wait_listening(c: Cluster, pods: list[str], timeout: float = 10.0) -> None:
    """Until every pod's pushsrv accepts (it starts after the netns exists)."""
    deadline = time.monotonic() + timeout
    for name in pods:
        while True:
            with inside(c.ns(name)):
                s = socket.socket()
            try:
                s.settimeout(0.5)
                s.connect((pod_ip(name), 8081))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            finally:
                s.close()


class Line:
    """A TCP connection to pushsrv through a frontend, read line by line."""

    def __init__(self, ns: str, addr: str, port: int, timeout: float = 3.0, bind: tuple[str, int] | None = None) -> None:
        with inside(ns):
            self.sock = socket.socket()
        self.buf = b""
        try:
            self.sock.settimeout(timeout)
            if bind:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.sock.bind(bind)
            self.sock.connect((addr, port))
            self.name, self.peer = self.line().split()[:2]
        except BaseException:
            self.sock.close()
            raise

    def line(self) -> str:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def ask(self, text: str) -> str:
        self.sock.sendall(text.encode() + b"\n")
        return self.line()

    def send(self, text: str) -> None:
        self.sock.sendall(text.encode() + b"\n")

    def close(self) -> None:
        self.sock.close()
