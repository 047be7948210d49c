"""New connections per second, and CPU per connection, with 10 and with 10,000 Services, side by
side in one run: a direct connection, usproxy's relay, the nftables datapath, the iptables
datapath (iptables-nft and iptables-legacy) and, where IPVS is (the VM lab's ipvs guest), the IPVS
datapath. Not a test.

    sudo .venv/bin/python -m bench.service_scale [--sizes 10,10000] [--rounds 3] [--seconds 2]
                                                [--contenders direct,relay,nftables,iptables-nft,ipvs]

Each contender gets its own bench topology (client, node and server network namespaces, as
bench/topology.py builds them), so no contender's rules lie in another's path: iptables' nat hook
would otherwise walk its 10,000 rules for the packets of the others. The bench Service (the
server's short-connection port, one endpoint) is served among N-1 others (two endpoints each,
addresses nothing answers on); its namespace sorts last, so in iptables a new connection walks
every other Service's KUBE-SERVICES rule before its own, which is kube-proxy's worst case (a
Service in the middle walks half). The kernel datapaths are programmed by their datapath classes
(what the agent calls, without the relay); the relay is `usproxy run --offload none` on a
manifest of the N Services.

The client opens connections (64 concurrent, from 16 source addresses, one request and answer
each, the server closes first) for --seconds per round; rounds rotate the contender order.
CPU per connection is the CPU of the client, the server and (relay) the agent inside the window:
the kernel's netfilter work for a packet runs in the softirq of the task that sent it, so it is
charged to the client or the server. Medians over rounds (the ratio to direct: the median of
per-round ratios); the machine's load average is recorded
(it is shared). Results go to bench/results/service_scale.json and print as a table.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.contenders import Agent, Ctx
from bench.procs import PYTHON, Procs, cpu_seconds
from bench.servers import CONN, CONN_SIZE
from bench.topology import SERVER_IP, BenchTopology, inside
from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import NodeFacts
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName

RESULTS = Path(__file__).parent / "results"
VIP = "10.96.100.10"
BENCH = ServicePortName("zz-bench", "conn", "c", "TCP")  # sorts after every "bench/svc-N"
CONCURRENCY = 64
TAIL = 0.2  # seconds at the end of a window left out of the CPU reading


def states(n: int) -> dict[ServicePortName, ServicePortState]:
    """The bench Service and n-1 others."""
    out = {}
    for i in range(n - 1):
        name = ServicePortName("bench", f"svc-{i}", "http", "TCP")
        vip = ipaddress.ip_address(int(ipaddress.ip_address("10.97.0.1")) + i)
        base = int(ipaddress.ip_address("10.245.0.0")) + 2 * i + 2
        eps = tuple(Endpoint(ipaddress.ip_address(base + k), 8080, node_name="node-1") for k in (0, 1))
        out[name] = ServicePortState(ServicePort(name=name, cluster_ips=(vip,), port=80, target_port=8080), eps, eps, eps)
    ep = (Endpoint(ipaddress.ip_address(SERVER_IP), CONN, node_name="node-1"),)
    sp = ServicePort(name=BENCH, cluster_ips=(ipaddress.ip_address(VIP),), port=CONN, target_port=CONN)
    out[BENCH] = ServicePortState(sp, ep, ep, ep)
    return out


def manifest(n: int) -> list[dict[str, Any]]:
    """The same Services as Kubernetes objects, for the relay's agent."""
    items: list[dict[str, Any]] = []
    for spn, st in states(n).items():
        sp = st.service_port
        port = {"name": spn.port, "port": sp.port, "targetPort": st.endpoints[0].port, "protocol": "TCP"}
        items.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": spn.name, "namespace": spn.namespace},
                      "spec": {"clusterIP": str(sp.cluster_ip), "ports": [port]}})
        items.append({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                      "metadata": {"name": f"{spn.name}-1", "namespace": spn.namespace,
                                   "labels": {"kubernetes.io/service-name": spn.name}},
                      "ports": [{"name": spn.port, "port": st.endpoints[0].port, "protocol": "TCP"}],
                      "endpoints": [{"addresses": [str(e.ip)], "conditions": {"ready": True}} for e in st.endpoints]})
    return items


class Contender:
    """One datapath in a topology of its own; `start(n)` programs n Services."""

    def __init__(self, name: str, work: Path) -> None:
        self.name, self.work = name, work
        self.topo = BenchTopology()
        self.procs = Procs()
        self.server_pid = 0
        self.proxy_pid: int | None = None
        self.target = VIP
        self.setup_s = 0.0

    def start(self, n: int) -> None:
        self.topo.build()
        p = self.procs.spawn(self.topo.server, [PYTHON, "-m", "bench.servers", "srv"], stdout=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.readline()
        self.server_pid = p.pid
        t0 = time.monotonic()
        self.program(n)
        self.setup_s = time.monotonic() - t0
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """One short connection from the client answered, retried until `timeout`."""
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            try:
                with inside(self.topo.client):
                    s = socket.create_connection((self.target, CONN), timeout=1.0)
                with s:
                    s.sendall(b"c" * CONN_SIZE)
                    if s.recv(CONN_SIZE):
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: {self.target}:{CONN} not answering: {last}")

    def program(self, n: int) -> None:
        self.target = SERVER_IP

    def stop(self) -> None:
        self.procs.close()
        self.topo.close()


class Relay(Contender):
    def program(self, n: int) -> None:
        self.agent = Agent(Ctx(self.topo, self.procs, self.work / self.name), self.name, 1)
        self.agent.start(manifest(n), timeout=600.0)
        self.proxy_pid = self.agent.proc.pid


class Kernel(Contender):
    def __init__(self, name: str, work: Path, kind: str, backend: str | None = None) -> None:
        super().__init__(name, work)
        self.kind, self.backend = kind, backend

    def program(self, n: int) -> None:
        asyncio.run(self._program(n))

    async def _program(self, n: int) -> None:
        if self.kind == "iptables":
            from usproxy.offload.iptables.datapath import IptablesDatapath

            dp: Any = IptablesDatapath(netns=self.topo.node, node=NodeFacts("node-0"), backend=self.backend)  # type: ignore[arg-type]
        elif self.kind == "ipvs":
            from usproxy.offload.ipvs.datapath import IpvsDatapath

            dp = IpvsDatapath(netns=self.topo.node, node=NodeFacts("node-0"))
        else:
            from usproxy.offload.nftables.datapath import NftablesDatapath

            dp = NftablesDatapath(netns=self.topo.node, node=NodeFacts("node-0"))
        try:
            cap = dp.probe()
            if not cap.available:
                raise RuntimeError(f"{self.name}: {cap.detail}")
            await dp.read_back()
            await dp.apply(states(n))
        finally:
            dp.close()  # the rules stay; the namespace goes with the topology


def measure(c: Contender, seconds: float) -> dict[str, float]:
    """One window of new connections: (connections/s, CPU seconds per 10k connections)."""
    now = time.monotonic()
    start, end = now + 0.8, now + 0.8 + seconds
    spec = {"op": "conn", "target": c.target, "conc": CONCURRENCY, "sources": c.topo.sources, "start": start, "end": end}
    client = c.procs.spawn(c.topo.client, [PYTHON, "-m", "bench.clients", json.dumps(spec)], stdout=subprocess.PIPE)
    pids = [client.pid, c.server_pid, *([c.proxy_pid] if c.proxy_pid else [])]
    marks: list[float] = []

    def sample() -> None:
        # CPU is read over [start, end - TAIL]: the client exits right after `end`, and a late
        # wake-up must not find it gone (then the round has no CPU figure)
        for t in (start, end - TAIL):
            time.sleep(max(0.0, t - time.monotonic()))
            try:
                marks.append(sum(cpu_seconds(p) for p in pids))
            except OSError:
                return

    th = threading.Thread(target=sample)
    th.start()
    out, _ = client.communicate(timeout=seconds + 60)
    th.join()
    c.procs.stop(client)
    r = json.loads([ln for ln in out.decode().splitlines() if ln.startswith("{")][-1])
    cps = max(1, r["conns"]) / r["seconds"]
    cpu = (marks[1] - marks[0]) / (cps * (seconds - TAIL) / 1e4) if len(marks) == 2 else float("nan")
    return {"cps": cps, "cpu_s_per_10k": cpu, "errors": r["errors"]}


def contenders_of(names: list[str], work: Path) -> list[Contender]:
    make: dict[str, Callable[[], Contender]] = {"direct": lambda: Contender("direct", work), "relay": lambda: Relay("relay", work),
            "nftables": lambda: Kernel("nftables", work, "nftables"),
            "iptables-nft": lambda: Kernel("iptables-nft", work, "iptables", "nft"),
            "iptables-legacy": lambda: Kernel("iptables-legacy", work, "iptables", "legacy"),
            "ipvs": lambda: Kernel("ipvs", work, "ipvs")}
    return [make[n]() for n in names]


def run(sizes: list[int], rounds: int, seconds: float,
        names: tuple[str, ...] = ("direct", "relay", "nftables", "iptables-nft", "iptables-legacy")) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="usproxy-svcscale-"))
    rows = []
    for n in sizes:
        contenders = contenders_of(list(names), work)
        try:
            for c in contenders:
                c.start(n)
                print(f"[{n} Services] {c.name} up ({c.setup_s:.1f} s to program)", flush=True)
            samples: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
            for r in range(rounds):
                for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
                    samples[c.name].append(measure(c, seconds))
            for c in contenders:
                s = samples[c.name]
                rows.append({"services": n, "contender": c.name, "program_s": round(c.setup_s, 2),
                             "cps": round(statistics.median(x["cps"] for x in s)),
                             "cpu_s_per_10k": round(statistics.median(
                                 [x["cpu_s_per_10k"] for x in s if not math.isnan(x["cpu_s_per_10k"])] or [math.nan]), 3),
                             "cps_rounds": [round(x["cps"]) for x in s],
                             "of_direct": round(statistics.median(
                                 x["cps"] / d["cps"] for x, d in zip(s, samples["direct"], strict=True)), 3),
                             "errors": sum(x["errors"] for x in s), "rounds": rounds})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for c in contenders:
                c.stop()
    return rows


def bridge_netfilter() -> None:
    """br_netfilter, as on this project's machines: the client and the server share the node's
    bridge, so without it the server's answer is bridged straight to the client and never meets
    the node's DNAT to be reversed (every kernel datapath's SYNs went unanswered in the VM lab's
    guest, whose kernel has br_netfilter as a module)."""
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        subprocess.run(["modprobe", "br_netfilter"], check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,10000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--contenders", default="direct,relay,nftables,iptables-nft,iptables-legacy")
    ap.add_argument("--out", default="service_scale.json", help="file name under bench/results")
    args = ap.parse_args()
    bridge_netfilter()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = run([int(x) for x in args.sizes.split(",")], args.rounds, args.seconds, tuple(args.contenders.split(",")))
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    RESULTS.mkdir(exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_before": load_before,
            "loadavg_after": load_after, "rounds": args.rounds, "seconds": args.seconds, "results": rows}
    (RESULTS / args.out).write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))
    print(f"{'services':>8} {'contender':>16} {'conn/s':>8} {'of direct':>9} {'CPU s/10k':>10} {'program s':>10}")
    for r in rows:
        ratio = r["of_direct"]
        print(f"{r['services']:>8} {r['contender']:>16} {r['cps']:>8} {ratio:>9.2f} {r['cpu_s_per_10k']:>10} {r['program_s']:>10}")


if __name__ == "__main__":
    main()
