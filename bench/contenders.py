"""The contenders of the data-plane runs: direct, usproxy relay, usproxy offloaded, HAProxy, prototypes.

Every contender forwards the bench server's ports (servers.py) unchanged from its own address
(`target`), so the client tool and the server are the same for all. A contender that cannot run
here stays in the results as "unavailable: <reason>". `pids()` names the processes whose CPU is
the proxy's cost (none for kernel paths).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.procs import PYTHON, ROOT, Procs
from bench.servers import BULK, CONN, HOLD, HTTP, IPERF, IPERF_ROUTED, REDIS, RR, RR_SIZE, UDP
from bench.topology import ROUTED_IP, SERVER_IP, BenchTopology, inside

USPROXY = str(ROOT / ".venv" / "bin" / "usproxy")
TCP_PORTS = (BULK, RR, CONN, HOLD, HTTP, IPERF, REDIS)
UDP_PORTS = (UDP, IPERF)  # iperf3 -u sends its datagrams to its TCP control port


@dataclass
class Ctx:
    """What contenders need: the topology, the process registry, a scratch directory."""

    topo: BenchTopology
    procs: Procs
    work: Path


@dataclass
class Contender:
    name: str
    target: str
    udp: bool = True
    available: bool = True
    reason: str = ""
    pid: int | None = None
    notes: str = ""
    max_conns: int = 0  # a configured connection limit (0: none)
    iperf_port: int = IPERF  # the port its iperf3 runs dial
    iperf_udp: bool = False  # iperf3 -u through it even where `udp` is off (bench's own UDP rows)

    def start(self, ctx: Ctx) -> None:
        """Bring the contender up; sets available/reason on failure instead of raising."""

    def stop(self, ctx: Ctx) -> None:
        """Stop what start() started."""

    def pids(self) -> list[int]:
        if self.pid is None:
            return []
        return [self.pid, *_children(self.pid)]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "available": self.available,
                "reason": self.reason, "udp": self.udp, "notes": self.notes}


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_ready(ctx: Ctx, target: str, timeout: float = 10.0) -> None:
    """One 1 KiB round trip from the client netns to target:RR, retried until `timeout`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with inside(ctx.topo.client):
                s = socket.create_connection((target, RR), timeout=1.0)
            with s:
                s.sendall(b"q" * RR_SIZE)
                got = 0
                while got < RR_SIZE:
                    chunk = s.recv(RR_SIZE)
                    if not chunk:
                        raise ConnectionError("closed")
                    got += len(chunk)
            return
        except OSError as err:
            last = err
            time.sleep(0.1)
    raise RuntimeError(f"{target}:{RR} not answering: {last}")


# -- direct ----------------------------------------------------------------------------------------
class Direct(Contender):
    def __init__(self) -> None:
        super().__init__("direct", SERVER_IP, notes="client → server pod, bridged on the node")


class RoutedDirect(Contender):
    """The pod dialled through the node's IP forwarding (and its conntrack, from the other
    contenders' tables), no NAT: the hop every ClusterIP datapath at the node adds to `direct`,
    so offloaded ÷ direct-routed is the datapath's own cost. Bench's own UDP rows skip it: the
    server's UDP sockets are bound to the wildcard address and answer from SERVER_IP, not ROUTED_IP.
    The real tools' UDP row (iperf3 -u) dials an `iperf3 -s` bound to ROUTED_IP (IPERF_ROUTED),
    which answers from it."""

    def __init__(self) -> None:
        super().__init__("direct-routed", ROUTED_IP, udp=False, iperf_port=IPERF_ROUTED, iperf_udp=True,
                         notes="client → node (routed: forwarding, conntrack, no NAT) → server pod; "
                               "UDP: iperf3 only")


# -- usproxy -----------------------------------------------------------------------------------------
def service_manifest(name: str, cluster_ip: str, endpoint: str, udp: bool = True,
                     annotations: dict[str, str] | None = None) -> list[dict[str, Any]]:
    ports = [{"name": f"p{p}", "port": p, "targetPort": p, "protocol": "TCP"} for p in TCP_PORTS]
    if udp:
        ports += [{"name": f"u{p}", "port": p, "targetPort": p, "protocol": "UDP"} for p in UDP_PORTS]
    meta: dict[str, Any] = {"name": name, "namespace": "bench"}
    if annotations:
        meta["annotations"] = annotations
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
           "spec": {"clusterIP": cluster_ip, "type": "ClusterIP",
                    "ports": ports}}
    sl = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
          "metadata": {"name": f"{name}-1", "namespace": "bench", "labels": {"kubernetes.io/service-name": name}},
          "ports": [{"name": p["name"], "port": p["port"], "protocol": p["protocol"]} for p in ports],
          "endpoints": [{"addresses": [endpoint], "conditions": {"ready": True}}]}
    return [svc, sl]


def write_manifests(directory: Path, objects: list[dict[str, Any]]) -> float:
    """Replace directory/services.yaml atomically (rename); returns time.monotonic() after."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".services.yaml.tmp"
    tmp.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, sort_keys=False))
    os.rename(tmp, directory / "services.yaml")
    return time.monotonic()


@dataclass
class Agent:
    """`usproxy run` in the node netns, with its own VIP interface and admin ports."""

    ctx: Ctx
    label: str
    index: int
    offload: str = "none"
    extra: list[str] = field(default_factory=list)
    proc: Any = None
    pythonpath: str = ""  # another source tree to run the agent from (bench/relay_conn.py's baseline)

    @property
    def dir(self) -> Path:
        return self.ctx.work / f"agent-{self.label}"

    @property
    def healthz(self) -> str:
        return f"127.0.0.1:{10256 + 10 * self.index}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{10249 + 10 * self.index}"

    def start(self, objects: list[dict[str, Any]], timeout: float = 120.0) -> float:
        """Start with `objects`; returns seconds from spawn to the first completed sync."""
        write_manifests(self.dir, objects)
        argv = [USPROXY, "run", "--services", str(self.dir), "--offload", self.offload,
                "--healthz-bind-address", self.healthz, "--metrics-bind-address", self.metrics,
                "--vip-interface", f"usproxy{self.index}", *self.extra]
        t0 = time.monotonic()
        env = dict(os.environ, USPROXY_EVENT_LOOP="uvloop")
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        self.proc = self.ctx.procs.spawn(self.ctx.topo.node, argv, log=self.dir / "agent.log", env=env)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}: {self.log_tail()}")
            try:
                if not self.get(self.healthz, "/healthz")["lastUpdated"].startswith("0001-"):
                    return time.monotonic() - t0
            except (OSError, http.client.HTTPException):
                # not listening yet; with the node's wide ephemeral port range, a poll can even
                # connect to itself (TCP self-connect) and read its own request back
                pass
            time.sleep(0.02)
        raise RuntimeError(f"agent did not sync within {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.dir / "agent.log").read_text()[-1500:]
        except OSError:
            return ""

    def get(self, addr: str, path: str) -> Any:
        with inside(self.ctx.topo.node):
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
                body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def services(self) -> list[dict[str, Any]]:
        return list(self.get(self.metrics, "/services"))

    def stop(self) -> None:
        if self.proc is not None:
            self.ctx.procs.stop(self.proc, timeout=30.0)
            self.proc = None


class Usproxy(Contender):
    """The usproxy agent serving the bench Service, relayed or offloaded."""

    def __init__(self, name: str, cluster_ip: str, index: int, offload: str = "none", pythonpath: str = "") -> None:
        super().__init__(name, cluster_ip)
        self.index = index
        self.offload = offload
        self.pythonpath = pythonpath  # run the agent from this source tree (default: this one)
        if pythonpath:
            self.notes = f"usproxy from {pythonpath}"
        self.agent: Agent | None = None

    def start(self, ctx: Ctx) -> None:
        extra = ["--offload-after", "1"] if self.offload != "none" else []
        self.agent = Agent(ctx, self.name, self.index, self.offload, extra, pythonpath=self.pythonpath)
        try:
            self.agent.start(service_manifest("bench", self.target, SERVER_IP))
            self.pid = self.agent.proc.pid
            if self.offload != "none":
                self._wait_offloaded()
            wait_ready(ctx, self.target)
        except RuntimeError as err:
            self.available, self.reason = False, str(err).splitlines()[0][:300]

    def _wait_offloaded(self, timeout: float = 8.0) -> None:
        assert self.agent is not None
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = self.agent.services()
            if rows and all(r["datapath"] == self.offload for r in rows):
                self.pid = None  # the kernel carries the bytes: no proxy process to charge
                self.notes = f"/services datapath {self.offload}"
                return
            time.sleep(0.25)
        seen = sorted({f"{r['datapath']} ({r['reason']})" for r in rows}) or ["no ServicePorts"]
        raise RuntimeError(f"--offload {self.offload} did not move the Service to the kernel within "
                           f"{timeout:.0f}s: /services says {'; '.join(seen)}")

    def stop(self, ctx: Ctx) -> None:
        if self.agent is not None:
            self.agent.stop()


# -- HAProxy -------------------------------------------------------------------------------------------
class HAProxy(Contender):
    """Debian's HAProxy, `mode tcp`, one process, one thread, default buffers (no splice)."""

    def __init__(self, vip: str) -> None:
        super().__init__("haproxy", vip, udp=False, notes="haproxy 2.6 mode tcp, nbthread 1; no UDP",
                         max_conns=9000)
        self.proc: Any = None

    def config(self) -> str:
        lines = ["global", "  maxconn 9500", "  nbthread 1", "",
                 "defaults", "  mode tcp", "  timeout connect 5s", "  timeout client 300s",
                 "  timeout server 300s", "  maxconn 9500", ""]
        for p in TCP_PORTS:
            lines += [f"listen p{p}", f"  bind {self.target}:{p}", f"  server s1 {SERVER_IP}:{p}", ""]
        return "\n".join(lines)

    def start(self, ctx: Ctx) -> None:
        cfg = ctx.work / "haproxy.cfg"
        cfg.write_text(self.config())
        ctx.topo.add_vip(self.target)
        self.proc = ctx.procs.spawn(ctx.topo.node, ["haproxy", "-f", str(cfg), "-db"], log=ctx.work / "haproxy.log")
        self.pid = self.proc.pid
        try:
            wait_ready(ctx, self.target)
        except RuntimeError as err:
            self.available, self.reason = False, str(err)

    def stop(self, ctx: Ctx) -> None:
        if self.proc is not None:
            ctx.procs.stop(self.proc)


# -- prototypes ----------------------------------------------------------------------------------------
class Prototype(Contender):
    """A relay prototype from bench/prototypes/relay_proto.py (item 6), TCP only."""

    def __init__(self, name: str, vip: str, mode: str, workers: int = 1) -> None:
        # splice mode holds two pipes (4 descriptors) per flow beside its two sockets
        super().__init__(name, vip, udp=False, notes=f"bench/prototypes/relay_proto.py --mode {mode} --workers {workers}",
                         max_conns=3000 if mode == "splice" else 0)
        self.mode, self.workers = mode, workers
        self.proc: Any = None

    def start(self, ctx: Ctx) -> None:
        ctx.topo.add_vip(self.target)
        argv = [PYTHON, "-m", "bench.prototypes.relay_proto", "--listen", self.target, "--backend", SERVER_IP,
                "--ports", ",".join(str(p) for p in TCP_PORTS), "--mode", self.mode, "--workers", str(self.workers)]
        self.proc = ctx.procs.spawn(ctx.topo.node, argv, log=ctx.work / f"{self.name}.log")
        self.pid = self.proc.pid
        try:
            wait_ready(ctx, self.target)
        except RuntimeError as err:
            self.available, self.reason = False, str(err)

    def stop(self, ctx: Ctx) -> None:
        if self.proc is not None:
            ctx.procs.stop(self.proc)


def default_contenders(prototypes: bool, offloaded: str = "nftables") -> list[Contender]:
    """`offloaded`: the kernel datapath of the "offloaded" contender (one offloading agent per
    network namespace: a run measures one of them)."""
    out: list[Contender] = [Direct(), RoutedDirect(), Usproxy("relay", "10.96.100.10", 1), Usproxy("offloaded", "10.96.101.10", 2, offloaded),
                            HAProxy("10.96.200.10")]
    if prototypes:
        # --mode protocol (the relay's shape minus bookkeeping) is left out: under the short-connection
        # storm it died in uvloop ("double free or corruption"); run it by hand to investigate.
        out += [Prototype("proto-splice", "10.96.202.10", "splice"),
                Prototype("proto-splice-2w", "10.96.203.10", "splice", workers=2)]
    return out
