"""A process on a node connects to a ClusterIP (and to a LoadBalancer IP) whose only endpoint lives
on another node: the endpoint sees the node's own address as its client, in every datapath.

Two nodes (tests/cluster/cluster.py), an agent on each with the same Services, no cluster CIDR
(so nothing masquerades node traffic by the local-traffic detector, as kube-proxy without one).
Both nodes hold the Service addresses as local addresses on usproxy0, so a connection that left
with the ClusterIP as its source (the kernel's choice for a local destination) would be answered
to the endpoint's own node, which holds the same address, and never complete. The process does
not bind: the kernel picks the source, as for any client on the node. Datapaths: the relay on
both event loops (it re-originates from the node), nftables (the connection is DNATed by the
kernel: masqueraded as kube-proxy's IPVS mode does, commands.service_address_source), iptables
(the same, one rule in the ServicePort's KUBE-SVC chain: rules.SERVICE_ADDRESS_SOURCE) and BPF
(the socket LB rewrites connect() before the kernel picks a source; the client runs in its
cgroup).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster import LAN, Cluster, node_ip
from tests.netns import inside
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text
from usproxy.offload.bpf import loader
from usproxy.offload.pin_root import PIN_ROOT_ENV
from usproxy.util import cgroup2

pytestmark = pytest.mark.netns

CGROUP2 = cgroup2.mount_point()  # where this host mounts cgroup v2 (the agent's default --bpf-cgroup)
CLUSTER_IP, LB_IP, POD = "10.96.30.10", "198.51.100.30", "10.244.2.10"
DATAPATHS = {"relay-uvloop": ("none", "uvloop"), "relay-asyncio": ("none", "asyncio"),
             "nftables": ("nftables", "uvloop"), "iptables": ("iptables", "uvloop"), "bpf": ("bpf", "uvloop")}
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 80), timeout=3)
print(s.recv(128).decode().split()[1])
"""


def objects() -> list[tuple[str, dict[str, Any]]]:
    svc = {"metadata": {"name": "web", "namespace": "default"},
           "spec": {"type": "LoadBalancer", "clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
           "status": {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}}
    eps = {"metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
           "endpoints": [{"addresses": [POD], "conditions": {"ready": True}, "nodeName": "node-2"}]}
    return [("services", svc), ("endpointslices", eps)]


@contextlib.contextmanager
def bpf_dirs() -> Iterator[dict[int, tuple[Path, Path]]]:
    tag = secrets.token_hex(3)
    dirs = {i: (loader.BPFFS / f"usproxy-test-{tag}-n{i}", CGROUP2 / f"usproxy-test-{tag}-n{i}") for i in (1, 2)}
    for _, cg in dirs.values():
        cg.mkdir()
    try:
        yield dirs
    finally:
        for pins, cg in dirs.values():
            loader.remove(loader.PinLayout(pins))
            with contextlib.suppress(OSError):
                cg.rmdir()


def ask(c: Cluster, addr: str, cgroup: Path | None) -> str:
    """The client address the endpoint saw for a connection from a process on node 1 (in
    `cgroup` when given), or the error."""
    enter = ["nsenter", f"--net=/run/netns/{c.node(1)}", sys.executable, "-c", CLIENT, addr]
    if cgroup is not None:
        script = "echo $$ > {}/cgroup.procs && exec {}".format(cgroup, " ".join(f"'{a}'" for a in enter))
        proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=20)
    else:
        proc = subprocess.run(enter, capture_output=True, text=True, timeout=20)
    return proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]


async def placed(c: Cluster, want: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for i in (1, 2):
        while True:
            rows = await asyncio.to_thread(c.admin, i, "/services")
            if rows and all(want in r.get("datapath", "") for r in rows):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"n{i} not on {want}: {json.dumps(rows)[:2000]}\n{c.log(i)}")
            await asyncio.sleep(0.1)


@pytest.fixture
async def two_nodes(tmp_path: Path) -> AsyncIterator[tuple[Cluster, FakeApiServer]]:
    c = Cluster(tmp_path, nodes=2)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    try:
        c.build()
        c.add_pod(2, "web-b", POD)
        with inside(c.ns("lan")):
            await api.start()
        for kind, obj in objects():
            api.apply(kind, obj)
        (tmp_path / "kubeconfig").write_text(kubeconfig_text(api.url))
        yield c, api
    finally:
        await asyncio.to_thread(c.close)
        await api.stop()


@pytest.mark.parametrize("datapath", list(DATAPATHS))
async def test_the_endpoint_sees_the_nodes_address(two_nodes: tuple[Cluster, FakeApiServer], datapath: str) -> None:
    c, _ = two_nodes
    offload, loop = DATAPATHS[datapath]
    kc = c.tmp / "kubeconfig"
    flags = ("--offload", offload, "--offload-after", "0.5", "--min-sync-period", "200ms")
    with bpf_dirs() as dirs:
        try:
            for i in (1, 2):
                if offload == "bpf":
                    await asyncio.to_thread(c.start_agent, i, kc, *flags, "--bpf-cgroup", str(dirs[i][1]),
                                            use_nsenter=True, env={PIN_ROOT_ENV: str(dirs[i][0])})
                else:
                    await asyncio.to_thread(c.start_agent, i, kc, *flags, env={"USPROXY_EVENT_LOOP": loop})
            await placed(c, {"none": "userspace"}.get(offload, offload))
            cgroup = dirs[1][1] if offload == "bpf" else None
            for addr in (CLUSTER_IP, LB_IP):
                assert await asyncio.to_thread(ask, c, addr, cgroup) == node_ip(1), (datapath, addr, c.log(1))
        finally:
            for i in list(c.agents):  # before the pins and the cgroup go
                await asyncio.to_thread(c.stop_agent, i)
