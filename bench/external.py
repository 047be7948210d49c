"""Bench: external traffic to a NodePort, BPF at tc (SNAT, DSR) and XDP against nftables (issue 16).

  sudo .venv/bin/python -m bench.external [--rounds N] [--quick] [--no-xdp] [--stem NAME] [--keep-logs DIR]

Topology (tests/cluster/cluster.py's Cluster with five nodes, every name prefixed `usb…`):
```
 ext 203.0.113.10-25,40-55 (bench.clients) ── lan router/bridge 192.0.2.1 (fake API server) ┬── n1 192.0.2.11: backend node,
                                                                                         │     pod 10.244.1.10 (bench.servers)
   n2 192.0.2.12 --offload nftables      n3 --offload bpf (tc, SNAT)                     │     agent: bpf, DSR mode
   n4 --offload bpf --bpf-lb-mode dsr    n5 --offload bpf --bpf-lb-acceleration native (XDP, SNAT)
```
One Service, type NodePort, externalTrafficPolicy Cluster, ports 5001 (bulk), 5002 (1 KiB
request/response), 5003 (short connections) with nodePort = port (bench.clients dials those
ports), one endpoint: the pod on n1. Every ingress node n2..n5 sees the same Service and the same
endpoint on another node; each contender is one ingress node, so all run side by side and no
agent restarts between rounds. `direct` dials the pod address (routed lan → n1 → pod), the path
without any NodePort, from client addresses of its own (DIRECT_SOURCES says why). In SNAT modes
the reply comes back through the ingress node; in DSR the ingress node hands the client's
address to n1 (IP option) and the reply leaves n1 straight to the lan router. n1 runs a BPF agent in DSR mode (DSR needs it to answer with the NodePort address);
its tc programs see every contender's packets alike, `direct` included.

Method: rounds interleaved as bench/dataplane.py (the contender order rotates per round; each
metric runs for every contender before the next). Metrics with bench.clients: new connections/s
(64 B each way, server closes first, c=64 over 2 processes and 16 source addresses), 1 KiB
request/response at c=16, bulk (one stream, `--bulk-mib`). Ratios: the median over rounds of
(contender ÷ nftables in that round).

CPU per 10,000 new connections on the ingress node: every namespace shares one kernel, and the
receive work of a veth runs on the CPU that sent into it, so no CPU belongs to a node by itself.
The bench makes one (Testbed.steer): RPS sends the receive work of the ingress nodes' eth0 to CPU
1 (NODE_CPU) and that of every other interface (client, lan router, backend node, pod) to CPU 0;
the forwarding, NAT and tc programs of an ingress node then run in CPU 1's softirq, up to the
handoff to the lan's veth, whose receive work goes back to CPU 0. XDP runs before RPS, in the NAPI
poll of the CPU that sent into the veth: the XDP node's eth0 NAPI is made a kernel thread pinned
to CPU 1, and its lan-side peer's (where XDP_TX lands) a thread pinned to CPU 0. Node CPU = CPU
1's softirq time (/proc/stat, tick-sampled: this kernel has no IRQ time accounting, HZ 250) plus
that NAPI thread's time, over the measurement window, per 10,000 connections (and per 10,000
requests, per GiB). `direct` has no ingress node: its figure is what else lands on CPU 1's
softirq (other processes' timers, other load on the machine); "over direct" subtracts it, round by
round. The machine's kernel and busy time per unit are in the JSON as well. Steering applies to
every contender alike, and it is not how a real node runs: the rates are those of this layout.

XDP on veth needs an XDP program at the lan side of n5's eth0 (Cluster.uplink_xdp) and complete checksums
from the client (tx checksum offload off in ext, which also turns off TSO): with XDP included
every contender shares that client, so bulk is segmented by the client for all, and the XDP
contender runs on threaded NAPI (see above), which costs it a thread wakeup per poll. The pod
keeps no TIME_WAIT (Testbed.build says why). `--no-xdp`
leaves n5 out and keeps the client's offloads. Everything (netns, processes, pins under
/sys/fs/bpf/usproxy-bench16-*, cgroups) is removed on exit, also on failure and Ctrl-C.
Results: bench/results/<stem>.json (every sample) and .md (the table); reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from bench.procs import CLK_TCK, PYTHON, ROOT, Procs, cpu_seconds, run_json
from bench.report import RESULTS
from bench.run import machine
from bench.servers import BULK, CONN, RR
from tests.cluster.cluster import EXT, LAN, Cluster, node_ip
from tests.netns import inside, nsexec
from usproxy.offload.bpf import loader
from usproxy.offload.pin_root import PIN_ROOT_ENV
from usproxy.util import cgroup2

POD = "10.244.1.10"
BACKEND_NODE = 1
SOURCES = [EXT] + [f"203.0.113.{11 + i}" for i in range(15)]
# direct's own client addresses (the route to the pod's /24 prefers the first), so no state one
# path leaves on the backend node (TIME_WAIT, the DSR reply entries kept 10 s past a close) meets
# another path's connection from the same address and port. (Until dsr.h dropped a stale DSR
# reply entry on a SYN without the option, such a direct connection stalled: found by this bench.)
DIRECT_SOURCES = [f"203.0.113.{40 + i}" for i in range(16)]
CGROUP2 = cgroup2.mount_point()  # where this host mounts cgroup v2 (the agent's default --bpf-cgroup)
PIN_PREFIX = "usproxy-bench16-"
COMMON = ("--offload-after", "0.5", "--min-sync-period", "200ms")
SYSCTLS = ("net.ipv4.ip_local_port_range=1024 65535", "net.ipv4.tcp_tw_reuse=1",
           "net.core.somaxconn=65535", "net.ipv4.tcp_max_syn_backlog=65535")
# bench.servers' main() ends with os._exit, which would swallow the error that ended it: print it
SERVE = ("import sys, traceback\nfrom bench.servers import Server, raise_nofile\nraise_nofile()\n"
         "srv = Server('pod')\nsrv.listen()\nprint('ready', flush=True)\ntry:\n    srv.serve()\n"
         "except BaseException:\n    traceback.print_exc()\n    sys.stdout.flush()\n    raise\n")
NODE_CPU = 1  # the CPU the ingress nodes' receive work is steered to (see Testbed.steer)
GiB = 1 << 30
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


@dataclass(frozen=True, slots=True)
class Contender:
    """One way to the backend: `node` is the ingress node (None: dial the pod), `flags` its agent's
    datapath flags, `datapath` what its /services rows must say before the bench trusts it."""

    name: str
    node: int | None
    flags: tuple[str, ...] = ()
    datapath: str = "bpf"

    @property
    def target(self) -> str:
        return POD if self.node is None else node_ip(self.node)


def contenders(xdp: bool) -> list[Contender]:
    """direct, then one ingress node per datapath (n2..n5; n1 is the backend node)."""
    out = [Contender("direct", None),
           Contender("nftables", 2, ("--offload", "nftables"), "nftables"),
           Contender("bpf-tc-snat", 3, ("--offload", "bpf", "--bpf-lb-mode", "snat")),
           Contender("bpf-tc-dsr", 4, ("--offload", "bpf", "--bpf-lb-mode", "dsr"))]
    if xdp:
        out.append(Contender("bpf-xdp-snat", 5, ("--offload", "bpf", "--bpf-lb-mode", "snat",
                                                 "--bpf-lb-acceleration", "native")))
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    """Rounds; bulk bytes per run; measurement window and warm-up of rr and conn (s); concurrency."""

    rounds: int
    bulk_bytes: int
    duration: float
    warmup: float
    rr_conc: int = 16
    conn_conc: int = 64


# -- the cluster ----------------------------------------------------------------------------------------
def service() -> dict[str, Any]:
    ports = [{"name": n, "port": p, "protocol": "TCP", "targetPort": p, "nodePort": p}
             for n, p in (("bulk", BULK), ("rr", RR), ("conn", CONN))]
    return {"metadata": {"name": "bench", "namespace": "default"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.16.10", "clusterIPs": ["10.96.16.10"],
                     "externalTrafficPolicy": "Cluster", "ports": ports}}


def endpoint_slice() -> dict[str, Any]:
    return {"metadata": {"name": "bench-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "bench"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [POD], "conditions": {"ready": True}, "nodeName": f"node-{BACKEND_NODE}"}],
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in (("bulk", BULK), ("rr", RR), ("conn", CONN))]}


class ApiThread:
    """The fake API server on the lan router, served by its own event loop in a daemon thread."""

    def __init__(self, lan_ns: str) -> None:
        from tests.sources.fake_apiserver import FakeApiServer

        self.api = FakeApiServer(bookmark_interval=1.0, host=LAN)
        self.loop = asyncio.new_event_loop()
        self.lan_ns = lan_ns
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, objects: list[tuple[str, dict[str, Any]]]) -> str:
        """Listen, hold `objects` (resource, object); returns the kubeconfig text."""
        from tests.sources.fake_apiserver import kubeconfig_text

        with inside(self.lan_ns):  # the listening socket is made in the lan netns, then stays there
            self.loop.run_until_complete(self.api.start())
        for resource, obj in objects:
            self.api.apply(resource, obj)
        self.thread.start()
        return kubeconfig_text(self.api.url)

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.api.stop(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        self.loop.close()


class Testbed:
    """Namespaces, the fake API server, the agents and the bench server; `close()` removes them all."""

    def __init__(self, work: Path, cast: list[Contender], procs: Procs, keep_logs: Path | None = None) -> None:
        self.work, self.cast, self.procs, self.keep_logs = work, cast, procs, keep_logs
        self.nodes = max([BACKEND_NODE] + [c.node for c in cast if c.node is not None])
        self.cluster = Cluster(work, nodes=self.nodes, prefix="usb" + secrets.token_hex(3))
        self.tag = secrets.token_hex(3)
        self.api: ApiThread | None = None
        self.dirs: dict[int, tuple[Path, Path]] = {}
        self.xdp_node = next((c.node for c in cast if "native" in c.flags), None)
        self.napi: list[int] = []
        self.server: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> str:
        return self.cluster.ns("ext")

    def pins(self, i: int) -> Path:
        return loader.BPFFS / f"{PIN_PREFIX}{self.tag}-n{i}"

    def build(self) -> None:
        """Namespaces, the bench server in the pod, the API server, every agent offloaded, steering."""
        pod = self._network()
        self._serve(pod)
        self.api = ApiThread(self.cluster.ns("lan"))
        kubeconfig = self.work / "kubeconfig"
        kubeconfig.write_text(self.api.start([("services", service()), ("endpointslices", endpoint_slice())]))
        agents: dict[int, tuple[str, ...]] = {BACKEND_NODE: ("--offload", "bpf", "--bpf-lb-mode", "dsr")}
        agents.update({x.node: x.flags for x in self.cast if x.node is not None})
        for i, flags in sorted(agents.items()):
            self._start_agent(i, kubeconfig, flags)
        for x in self.cast:
            if x.node is not None:
                self._wait_datapath(x.node, x.datapath)
        self._wait_datapath(BACKEND_NODE, "bpf")
        self.steer()

    def _network(self) -> str:
        """The cluster's namespaces, the client's extra addresses, the pod; returns the pod's netns."""
        c = self.cluster
        c.build()
        if self.xdp_node is not None:
            c.uplink_xdp(self.xdp_node)
            c.wire_checksums(c.ns("ext"))  # the client's tx checksum offload off (see the docstring)
        for src in SOURCES[1:] + DIRECT_SOURCES:
            nsexec(self.client, "ip", "addr", "add", f"{src}/24", "dev", "eth0")
        nsexec(self.client, "ip", "route", "add", "10.244.1.0/24", "via", "203.0.113.1", "src", DIRECT_SOURCES[0])
        pod = c.add_pod(BACKEND_NODE, "pod", POD, serve=False)
        for ns in c.namespaces:
            for kv in SYSCTLS:
                nsexec(ns, "sysctl", "-qw", kv, check=False)
            # Short connections leave conntrack entries in TIME_WAIT (nftables node, router): keep
            # them from piling up across rounds. These namespaces only.
            nsexec(ns, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1", check=False)
        # No TIME_WAIT at the server (it closes first): direct and DSR reach it with the same client
        # address and port, and the SNAT nodes reuse ports across client addresses, each with its
        # own TCP timestamp offset; a SYN meeting a TIME_WAIT of another path fails PAWS and waits
        # for its retransmission (1 s and more), which no path's own speed has to do with.
        nsexec(pod, "sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0")
        return pod

    def _serve(self, pod: str) -> None:
        """bench.servers in the pod, its output in work/server.log; returns once it listens."""
        out = self.work / "server.log"
        server = self.procs.spawn(pod, [PYTHON, "-c", SERVE], log=out)
        self.server = server
        deadline = time.monotonic() + 10
        while b"ready" not in out.read_bytes():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bench.servers did not start: {out.read_text()}")
            time.sleep(0.05)

    def steer(self) -> None:
        """Receive work of the ingress nodes' eth0 on NODE_CPU, every other interface's on CPU 0
        (RPS); the XDP node's eth0 NAPI as a thread pinned to NODE_CPU (XDP runs before RPS, in
        the NAPI poll of the CPU that sent into the veth)."""
        ingress = {self.cluster.node(c.node) for c in self.cast if c.node is not None}
        for ns in self.cluster.namespaces:
            own = 1 << NODE_CPU if ns in ingress else 1
            nsexec(ns, "sh", "-c", "for q in /sys/class/net/*/queues/rx-*/rps_cpus; do "
                   f"case $q in /sys/class/net/eth0/*) echo {own:x} > $q;; *) echo 1 > $q;; esac; done")
        if self.xdp_node is not None:
            self.napi = threaded_napi(self.cluster.node(self.xdp_node), "eth0", NODE_CPU)
            # XDP_TX hands frames to the lan side's NAPI on the current CPU: keep the lan's work
            # (its pass-all XDP program, the bridge) off NODE_CPU, as RPS does for other nodes
            lan = threaded_napi(self.cluster.ns("lan"), self.cluster.uplinks[self.xdp_node], 0)
            log(f"XDP node: eth0 NAPI threads {self.napi} on CPU {NODE_CPU}, its lan port's {lan} on CPU 0")

    def node_cpu(self) -> float:
        """CPU seconds so far of the ingress nodes' forwarding: NODE_CPU's softirq time (/proc/stat,
        tick-sampled) plus the XDP node's NAPI threads' utime+stime."""
        line = Path("/proc/stat").read_text().split(f"cpu{NODE_CPU} ", 1)[1].split("\n", 1)[0].split()
        total = int(line[6]) / CLK_TCK  # user nice system idle iowait irq softirq
        for pid in self.napi:
            with contextlib.suppress(OSError):
                total += cpu_seconds(pid)
        return total

    def _start_agent(self, i: int, kubeconfig: Path, flags: tuple[str, ...]) -> None:
        env = {"PYTHONPATH": str(ROOT)}
        extra: tuple[str, ...] = ()
        if "bpf" in flags:
            pins, cg = self.pins(i), CGROUP2 / f"{PIN_PREFIX}{self.tag}-n{i}"
            cg.mkdir()
            self.dirs[i] = (pins, cg)
            env[PIN_ROOT_ENV] = str(pins)
            extra = ("--bpf-cgroup", str(cg))
        log(f"agent n{i}: {' '.join(flags)}")
        self.cluster.start_agent(i, kubeconfig, *COMMON, *flags, *extra, use_nsenter=True, env=env)

    def _wait_datapath(self, i: int, datapath: str, timeout: float = 20.0) -> None:
        """Until every ServicePort on node i is carried by `datapath`, forwarded traffic included."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.cluster.admin(i, "/services")
            if rows and all(r.get("datapath") == datapath and "userspace" not in r.get("reason", "") for r in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"n{i} did not offload to {datapath}: {rows}\n{self.cluster.log(i)}")
            time.sleep(0.2)

    def describe(self, c: Contender) -> str:
        """The ingress node's view of the Service (its /services rows), for a failed measurement."""
        server = "server " + ("up" if self.server is not None and self.server.poll() is None
                              else f"gone: {self.server and self.server.returncode} {self._server_tail()}")
        if c.node is None:
            return server
        try:
            rows = self.cluster.admin(c.node, "/services")
        except OSError as err:
            return f"n{c.node}'s admin API: {err}; agent exit code {self.cluster.agents[c.node].poll()}"
        return f"{server}; n{c.node}: " + json.dumps(rows)[:300]

    def _server_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.work / "server.log").read_text()[-1500:]
        return ""

    def xdp_counters(self) -> dict[str, int] | None:
        """n5's usp_xdp_stats (new, known, pass), summed over CPUs: XDP really carried the flows."""
        if self.xdp_node is None:
            return None
        from usproxy.offload.bpf import libbpf as bpf
        from usproxy.offload.bpf.layout import pack_u32

        fd = bpf.obj_get(str(loader.PinLayout(self.pins(self.xdp_node)).maps / "usp_xdp_stats"))
        try:
            return {name: bpf.percpu_sum_u64(fd, pack_u32(k)) for k, name in enumerate(("new", "known", "pass"))}
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for f in [*self.work.glob("agent-*.log"), self.work / "server.log"]:
                with contextlib.suppress(OSError):
                    shutil.copy(f, self.keep_logs / f.name)
        # the agents' watch streams are cut below: aiohttp would log a traceback for each
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        self.cluster.close()  # agents (SIGTERM), the XDP link fds, every namespace
        if self.api is not None:
            with contextlib.suppress(Exception):
                self.api.stop()
        for pins, cg in self.dirs.values():
            loader.remove(loader.PinLayout(pins))
            with contextlib.suppress(OSError):
                cg.rmdir()


# -- measurements --------------------------------------------------------------------------------------
def napi_threads() -> list[int]:
    """Pids of the kernel's threaded-NAPI pollers (`napi/<dev>-<id>`)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if (d / "comm").read_text().startswith("napi/"):
                    out.append(int(d.name))
    return out


def threaded_napi(ns: str, dev: str, cpu: int) -> list[int]:
    """Turn `dev`'s NAPI in `ns` into kernel threads pinned to `cpu`; returns their pids."""
    before = set(napi_threads())
    nsexec(ns, "sh", "-c", f"echo 1 > /sys/class/net/{dev}/threaded")
    deadline = time.monotonic() + 3
    new: set[int] = set()
    while not new and time.monotonic() < deadline:
        time.sleep(0.05)
        new = set(napi_threads()) - before
    if not new:
        raise RuntimeError(f"no NAPI thread appeared for {dev} in {ns}")
    for pid in new:
        os.sched_setaffinity(pid, {cpu})
    return sorted(new)


def kernel_busy() -> tuple[float, float]:
    """(kernel, busy) CPU seconds of the whole machine so far: system+irq+softirq, and all but
    idle/iowait (/proc/stat's first line, in USER_HZ)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = f
    hz = os.sysconf("SC_CLK_TCK")
    return (system + irq + softirq) / hz, (user + nice + system + irq + softirq + steal) / hz


Samples = dict[str, dict[str, dict[int, float]]]  # metric -> contender -> round -> value


class Bench:
    def __init__(self, bed: Testbed, plan: Plan) -> None:
        self.bed, self.plan = bed, plan
        self.samples: Samples = {}
        self.round = 0

    def _record(self, metric: str, c: Contender, value: float) -> None:
        self.samples.setdefault(metric, {}).setdefault(c.name, {})[self.round] = value

    def _client(self, spec: dict[str, Any]) -> dict[str, Any]:
        return run_json(self.bed.procs, self.bed.client, "bench.clients", spec, timeout=300.0)

    def _cpu(self) -> tuple[float, float, float]:
        """(node, kernel, busy) CPU seconds so far: Testbed.node_cpu() and kernel_busy()."""
        return (self.bed.node_cpu(), *kernel_busy())

    def _windowed(self, c: Contender, spec: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
        """The client over [start, end]; returns its result and the (node, kernel, busy) CPU
        seconds inside that window (sampled by a thread at its edges)."""
        start = time.monotonic() + 0.3 + self.plan.warmup
        end = start + self.plan.duration
        marks: list[tuple[float, float, float]] = []

        def sample() -> None:
            time.sleep(max(0.0, start - time.monotonic()))
            marks.append(self._cpu())
            time.sleep(max(0.0, end - time.monotonic()))
            marks.append(self._cpu())

        th = threading.Thread(target=sample)
        th.start()
        result = self._client(dict(spec, target=c.target, start=start, end=end))
        th.join()
        return result, [y - x for x, y in zip(*marks)]

    def _record_cpu(self, prefix: str, c: Contender, cpu: list[float], per: float) -> None:
        """CPU ms per `per` units (10k connections, 10k requests, or s per GiB as the caller scales)."""
        for kind, secs in zip(("node", "kernel", "busy"), cpu):
            self._record(f"{prefix}_{kind}", c, secs / per)

    def verify(self, cast: list[Contender]) -> dict[str, bool]:
        """A checksummed transfer per contender (not timed): every path carries the bytes intact."""
        out = {}
        for c in cast:
            r = self._client({"op": "bulk", "target": c.target, "bytes": 64 << 20, "checksum": True})
            out[c.name] = bool(r["checksum_ok"])
            log(f"  checksum {c.name}: {'ok' if out[c.name] else 'MISMATCH'}")
        return out

    def bulk(self, c: Contender) -> None:
        before = self._cpu()
        r = self._client({"op": "bulk", "target": c.target, "bytes": self.plan.bulk_bytes})
        cpu = [y - x for x, y in zip(before, self._cpu())]
        self._record("bulk_gbps", c, r["bytes"] * 8 / r["seconds"] / 1e9)
        self._record_cpu("bulk_s_per_gib", c, cpu, r["bytes"] / GiB)

    def rr(self, c: Contender) -> None:
        r, cpu = self._windowed(c, {"op": "rr", "conc": self.plan.rr_conc})
        self._record(f"rr_c{self.plan.rr_conc}_rps", c, r["requests"] / r["seconds"])
        if r["requests"]:
            self._record_cpu("rr_ms_per_10k", c, cpu, r["requests"] / 1e7)

    def conn(self, c: Contender) -> None:
        sources = DIRECT_SOURCES if c.node is None else SOURCES
        r, cpu = self._windowed(c, {"op": "conn", "conc": self.plan.conn_conc, "sources": sources, "procs": 2})
        self._record("conn_cps", c, r["conns"] / r["seconds"])
        self._record("conn_errors", c, float(r["errors"]))
        if r["errors"] or not r["conns"]:
            log(f"  {c.name}: {r['conns']} connections, {r['errors']} errors; {self.bed.describe(c)}")
        if r["conns"]:
            self._record_cpu("conn_ms_per_10k", c, cpu, r["conns"] / 1e7)

    def run(self, cast: list[Contender]) -> None:
        steps: list[tuple[str, Callable[[Contender], None]]] = [("bulk", self.bulk), ("rr", self.rr), ("conn", self.conn)]
        for rnd in range(self.plan.rounds):
            self.round = rnd
            order = cast[rnd % len(cast):] + cast[:rnd % len(cast)]
            t0 = time.monotonic()
            for label, step in steps:
                for c in order:
                    try:
                        step(c)
                    except (RuntimeError, TimeoutError, KeyError) as err:
                        log(f"  round {rnd + 1} {label} {c.name}: failed: {err}")
            cps = self.samples.get("conn_cps", {})
            log(f"  round {rnd + 1}/{self.plan.rounds} in {time.monotonic() - t0:.0f}s, conn/s: "
                + " ".join(f"{c.name}={cps.get(c.name, {}).get(rnd, 0):.0f}" for c in order))


# -- summary ---------------------------------------------------------------------------------------------
def ratios(samples: Samples, baseline: str) -> dict[str, dict[str, float]]:
    """metric -> contender -> median over rounds of (contender ÷ baseline in that round)."""
    out: dict[str, dict[str, float]] = {}
    for metric, per in samples.items():
        base = per.get(baseline, {})
        for name, vals in per.items():
            rs = [v / base[r] for r, v in vals.items() if base.get(r)]
            if rs and name != baseline:
                out.setdefault(metric, {})[name] = statistics.median(rs)
    return out


def summary(bench: Bench) -> dict[str, Any]:
    s = bench.samples
    lists = {m: {c: [v[r] for r in sorted(v)] for c, v in per.items()} for m, per in s.items()}
    extra: Samples = {}  # the ingress node's share: node CPU minus direct's of the same round
    for metric in ("conn_ms_per_10k_node", "rr_ms_per_10k_node", "bulk_s_per_gib_node"):
        base = s.get(metric, {}).get("direct", {})
        extra[metric + "_over_direct"] = {name: {r: v - base[r] for r, v in vals.items() if r in base}
                                          for name, vals in s.get(metric, {}).items() if name != "direct"}
    return {"plan": {k: getattr(bench.plan, k) for k in Plan.__slots__},
            "median": {m: {c: statistics.median(v) for c, v in per.items() if v} for m, per in lists.items()},
            "samples": lists,
            "node_over_direct": {m: {c: statistics.median(v.values()) for c, v in per.items() if v} for m, per in extra.items()},
            "ratio_vs_nftables": ratios({**s, **extra}, "nftables")}


def _f(x: float | None, fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def markdown(results: dict[str, Any]) -> str:
    meta, d = results["meta"], results.get("summary", {})
    med, rat, over = d.get("median", {}), d.get("ratio_vs_nftables", {}), d.get("node_over_direct", {})
    rr = f"rr_c{d.get('plan', {}).get('rr_conc', 16)}_rps"
    lines = [f"# External traffic to a NodePort: BPF vs nftables ({meta['date']})", "",
             f"`{meta['command']}` ({meta['mode']}, {meta['rounds']} rounds, git {meta['git']}); {meta['machine']}; "
             f"load average {meta.get('loadavg_start', '?')} at start, {meta.get('loadavg_end', '?')} at end.", "",
             "Medians over rounds; × nft: median of the per-round ratios to nftables. Node CPU: CPU "
             f"{NODE_CPU}'s softirq time (the ingress nodes' receive work is steered there) plus the XDP node's "
             "NAPI thread, per 10,000 new connections; over direct: minus direct's figure of the same round "
             "(other work that lands on that CPU), i.e. the ingress node's cost.", "",
             "| path | new conn/s | × nft | 1 KiB rr c=16 /s | × nft | bulk Gbit/s | × nft "
             "| node CPU ms /10k conns | over direct | × nft |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in results["contenders"]:
        def m(metric: str, fmt: str) -> str:
            return _f(med.get(metric, {}).get(name), fmt)

        def r(metric: str) -> str:
            return "1" if name == "nftables" else "–" if name == "direct" and "over" in metric else \
                _f(rat.get(metric, {}).get(name), "{:.2f}")
        o = over.get("conn_ms_per_10k_node_over_direct", {}).get(name)
        lines.append(f"| {name} | {m('conn_cps', '{:,.0f}')} | {r('conn_cps')} | {m(rr, '{:,.0f}')} | {r(rr)} | "
                     f"{m('bulk_gbps', '{:.2f}')} | {r('bulk_gbps')} | {m('conn_ms_per_10k_node', '{:.0f}')} | "
                     f"{'–' if name == 'direct' else _f(o, '{:.0f}')} | {r('conn_ms_per_10k_node_over_direct')} |")
    lines += ["", "Node CPU over direct for the other loads:", "",
              "| path | ms /10k requests (1 KiB rr) | × nft | s /GiB (bulk) | × nft |", "|---|---:|---:|---:|---:|"]
    for name in results["contenders"]:
        if name == "direct":
            continue
        cells = []
        for metric, fmt in (("rr_ms_per_10k_node_over_direct", "{:.0f}"), ("bulk_s_per_gib_node_over_direct", "{:.3f}")):
            cells += [_f(over.get(metric, {}).get(name), fmt),
                      "1" if name == "nftables" else _f(rat.get(metric, {}).get(name), "{:.2f}")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = {c: sum(v) for c, v in d.get("samples", {}).get("conn_errors", {}).items() if sum(v)}
    lines += ["", f"Checksummed 64 MiB per path: {results.get('checksum_ok')}."]
    if errors:
        lines.append(f"Connection errors (all rounds): {errors}.")
    if results.get("xdp_counters") is not None:
        lines.append(f"XDP counters of the XDP node after the run (new, known, pass): {results['xdp_counters']}.")
    for name, why in results.get("left_out", {}).items():
        lines.append(f"Left out: {name}: {why}")
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], stem: str) -> tuple[Path, Path]:
    RESULTS.mkdir(exist_ok=True)
    jp, mp = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
    jp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    mp.write_text(markdown(results))
    return jp, mp


# -- the command ---------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.external", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, 1 s windows, 128 MiB bulk (~2 min)")
    ap.add_argument("--rounds", type=int, help="rounds (default 2 quick, 5 full)")
    ap.add_argument("--bulk-mib", type=int, help="bulk transfer per run, MiB (default 128 quick, 512 full)")
    ap.add_argument("--no-xdp", dest="xdp", action="store_false", help="leave the XDP contender out")
    ap.add_argument("--stem", help="results file name (default <date>-external[-quick])")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy the agents' and the server's logs to DIR at the end")
    return ap.parse_args()


def _interrupt(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def testbed(cast: list[Contender], keep_logs: Path | None) -> Iterator[Testbed]:
    """A Testbed (not built yet) whose processes, namespaces, pins and files go at the block's end."""
    procs, work = Procs(), Path(tempfile.mkdtemp(prefix="usproxy-bench16-"))
    bed = Testbed(work, cast, procs, keep_logs)
    try:
        yield bed
    finally:
        procs.close()
        bed.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    args = parse()
    if os.geteuid() != 0:
        print("bench.external needs root (network namespaces, BPF)", file=sys.stderr)
        return 2
    if NODE_CPU not in os.sched_getaffinity(0):
        print(f"bench.external steers the ingress nodes' work to CPU {NODE_CPU}: it needs two CPUs", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    quick = args.quick
    plan = Plan(rounds=args.rounds or (2 if quick else 5), bulk_bytes=(args.bulk_mib or (128 if quick else 512)) << 20,
                duration=1.0 if quick else 2.5, warmup=0.3 if quick else 0.5)
    stem = args.stem or datetime.date.today().isoformat() + "-external" + ("-quick" if quick else "")
    cast = contenders(args.xdp)
    from bench.run import _git_head

    results: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                 "mode": "quick" if quick else "full", "rounds": plan.rounds, "git": _git_head(),
                 "command": "sudo .venv/bin/python -m bench.external" + (" --quick" if quick else "")
                 + ("" if args.xdp else " --no-xdp"), "loadavg_start": _loadavg()},
        "contenders": [c.name for c in cast], "flags": {c.name: list(c.flags) for c in cast},
        "left_out": {} if args.xdp else {"bpf-xdp-snat": "--no-xdp"}}
    try:
        with testbed(cast, args.keep_logs) as bed:
            log(f"building {bed.cluster.prefix}-*: {bed.nodes} nodes, contenders {', '.join(c.name for c in cast)}")
            bed.build()
            bench = Bench(bed, plan)
            results["checksum_ok"] = bench.verify(cast)
            log(f"{plan.rounds} rounds × {len(cast)} contenders")
            try:
                bench.run(cast)
            finally:
                results["summary"] = summary(bench)
                results["xdp_counters"] = bed.xdp_counters()
    except KeyboardInterrupt:
        log("interrupted: cleaned up")
        results["meta"]["interrupted"] = True
    results["meta"]["loadavg_end"] = _loadavg()
    results["meta"]["seconds"] = round(time.monotonic() - T0, 1)
    jp, mp = write(results, stem)
    print(mp.read_text())
    log(f"wrote {jp}, {mp}")
    return 130 if results["meta"].get("interrupted") else 0


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    sys.exit(main())
