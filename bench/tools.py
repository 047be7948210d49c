"""The real tools as clients: wrk, iperf3 and redis-benchmark against nginx, `iperf3 -s` and redis-server.

Beside bench's own client (clients.py), the tools people measure proxies with, run through the
same contenders (direct, relay, offloaded, HAProxy) in the same interleaved rounds as the data
plane (dataplane.py's DataPlane: rotating order, each metric for every contender before the next,
ratios within a round, medians over rounds). The servers run in the server pod's netns on ports
HTTP, IPERF and REDIS (servers.py), which every contender forwards unchanged.

Metrics (units in the names):
- `http_close_rps`: wrk -t1 -c16 with `Connection: close` (one new TCP connection per request);
  `http_ka_rps`: wrk -t1 -c16, keep-alive. nginx answers `GET /` with a 3-byte body.
- `iperf_tcp1_gbps`, `iperf_tcp4_gbps`: iperf3 -P1 / -P4, receiver's bytes; `iperf_udp1400_gbps`:
  iperf3 -u -b 0 -l 1400 (unlimited offered load), receiver's bytes, so drops count against it.
- `redis_set_rps`, `redis_get_rps`: redis-benchmark -c16 -t set,get.
Proxy CPU per unit (per 10k requests, per GiB) is read from /proc around each tool run, so it
includes the tool's start-up and the end of its run (a few % of the window).

HAProxy 2.6 has no UDP: its UDP cell stays empty. A missing tool binary makes the phase report
itself unavailable (scripts/setup.sh installs them).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.contenders import Contender, Ctx
from bench.topology import ROUTED_IP
from bench.dataplane import GiB, DataPlane, Plan
from bench.servers import HTTP, IPERF, IPERF_ROUTED, REDIS

BINARIES = ("wrk", "iperf3", "redis-benchmark", "redis-server", "nginx")

NGINX_CONF = """daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  fastcgi_temp_path {work}/nginx-fastcgi;
  uwsgi_temp_path {work}/nginx-uwsgi;
  scgi_temp_path {work}/nginx-scgi;
  server {{
    listen {port} backlog=4096;
    location / {{ return 200 "ok\\n"; }}
  }}
}}
"""


@dataclass(frozen=True)
class ToolPlan:
    """Sizes of one tools phase: `seconds` per wrk/iperf3 run, `redis_requests` per redis-benchmark test."""

    rounds: int
    seconds: int
    redis_requests: int
    conc: int = 16


def missing() -> list[str]:
    """The tool binaries not on PATH (empty when the phase can run)."""
    return [b for b in BINARIES if shutil.which(b) is None]


class ToolServers:
    """nginx, `iperf3 -s` (twice: one bound to ROUTED_IP) and redis-server in the server pod's netns,
    stopped by close()."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        work, ns, spawn = self.ctx.work, self.ctx.topo.server, self.ctx.procs.spawn
        conf = work / "nginx.conf"
        conf.write_text(NGINX_CONF.format(work=work, port=HTTP))
        self.procs.append(spawn(ns, ["nginx", "-p", str(work), "-c", str(conf), "-e", str(work / "nginx-error.log")],
                                log=work / "nginx.log"))
        self.procs.append(spawn(ns, ["iperf3", "-s", "-p", str(IPERF)], log=work / "iperf3.log"))
        # direct-routed's: its UDP datagrams must come back from the address they were sent to
        self.procs.append(spawn(ns, ["iperf3", "-s", "-p", str(IPERF_ROUTED), "-B", ROUTED_IP],
                                log=work / "iperf3-routed.log"))
        self.procs.append(spawn(ns, ["redis-server", "--port", str(REDIS), "--bind", "0.0.0.0", "--save", "",
                                     "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)],
                                log=work / "redis.log"))
        time.sleep(0.5)  # all listen within milliseconds; the first tool run retries nothing
        dead = [p.args for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tool server exited: {dead}")

    def close(self) -> None:
        for p in self.procs:
            self.ctx.procs.stop(p)
        self.procs.clear()


# -- parsing ------------------------------------------------------------------------------------------------
def wrk_rps(out: str) -> tuple[float, int, int]:
    """(requests/s, requests, socket errors) from wrk's text report."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    reqs = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = sum(int(x) for x in m.groups()) if m else 0
    return rps, reqs, errors


def iperf_received(out: str) -> tuple[float, int]:
    """(receiver Gbit/s, receiver bytes) from `iperf3 -J`; TCP and UDP both carry end.sum_received."""
    end = json.loads(out)["end"]
    got = end["sum_received"]
    return got["bits_per_second"] / 1e9, int(got["bytes"])


def redis_rps(out: str) -> dict[str, float]:
    """{test: requests/s} from `redis-benchmark --csv` (header line, then "NAME","rps",...)."""
    rows: dict[str, float] = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] != "test":
            try:
                rows[cells[0]] = float(cells[1])
            except ValueError:
                continue
    return rows


# -- the phase ----------------------------------------------------------------------------------------------
class ToolPlane(DataPlane):
    """DataPlane's rounds and ratios with the real tools as the steps."""

    def __init__(self, ctx: Ctx, contenders: list[Contender], plan: ToolPlan, log: Callable[[str], None]) -> None:
        super().__init__(ctx, [c for c in contenders if c.name in ("direct", "direct-routed", "relay", "offloaded", "haproxy")],
                         Plan(rounds=plan.rounds, bulk_bytes=0, duration=float(plan.seconds)), log)
        self.tools = plan
        self.headline = "http_close_rps"

    def _tool(self, c: Contender, argv: list[str]) -> tuple[str, float | None]:
        """Run argv in the client netns; returns its stdout and the proxy's CPU seconds meanwhile."""
        before = self._cpu(c)
        p = self.ctx.procs.spawn(self.ctx.topo.client, argv, stdout=subprocess.PIPE)
        try:
            out, _ = p.communicate(timeout=self.tools.seconds * 4 + 60)
        except subprocess.TimeoutExpired:
            self.ctx.procs.stop(p)
            raise TimeoutError(f"{argv[0]} timed out")
        after = self._cpu(c)
        self.ctx.procs.stop(p)
        if p.returncode != 0:
            raise RuntimeError(f"{argv[0]} rc {p.returncode}: {out.decode()[-500:]}")
        cpu = None if before is None or after is None else after - before
        return out.decode(), cpu

    def wrk(self, c: Contender, close: bool) -> None:
        t = self.tools
        argv = ["wrk", "-t1", f"-c{t.conc}", f"-d{t.seconds}s", f"http://{c.target}:{HTTP}/"]
        if close:
            argv[1:1] = ["-H", "Connection: close"]
        out, cpu = self._tool(c, argv)
        rps, reqs, errors = wrk_rps(out)
        key = "http_close" if close else "http_ka"
        self._record(self.samples, f"{key}_rps", c, rps)
        self._record(self.samples, f"{key}_errors", c, float(errors))
        if cpu is not None and reqs:
            self._record(self.cpu, f"{key}_cpu_s_per_10k", c, cpu / (reqs / 1e4))

    def iperf(self, c: Contender, streams: int, udp: bool) -> None:
        if udp and not (c.udp or c.iperf_udp):
            return
        argv = ["iperf3", "-c", c.target, "-p", str(c.iperf_port), "-t", str(self.tools.seconds), "-J", "-P", str(streams)]
        if udp:
            argv += ["-u", "-b", "0", "-l", "1400"]
        out, cpu = self._tool(c, argv)
        gbps, nbytes = iperf_received(out)
        key = "iperf_udp1400" if udp else f"iperf_tcp{streams}"
        self._record(self.samples, f"{key}_gbps", c, gbps)
        if cpu is not None and nbytes:
            self._record(self.cpu, f"{key}_cpu_s_per_gib", c, cpu / (nbytes / GiB))

    def redis(self, c: Contender) -> None:
        argv = ["redis-benchmark", "-h", c.target, "-p", str(REDIS), "-c", str(self.tools.conc),
                "-n", str(self.tools.redis_requests), "-t", "set,get", "--csv"]
        out, _ = self._tool(c, argv)
        for test, rps in redis_rps(out).items():
            self._record(self.samples, f"redis_{test.lower()}_rps", c, rps)

    def verify(self) -> None:
        """The tools check their own transfers; nothing to verify beforehand."""

    def steps(self) -> list[tuple[str, Callable[[Contender], None]]]:
        return [("wrk close", functools.partial(self.wrk, close=True)),
                ("wrk keep-alive", functools.partial(self.wrk, close=False)),
                ("iperf3 -P1", functools.partial(self.iperf, streams=1, udp=False)),
                ("iperf3 -P4", functools.partial(self.iperf, streams=4, udp=False)),
                ("iperf3 -u 1400", functools.partial(self.iperf, streams=1, udp=True)),
                ("redis-benchmark", self.redis)]


def measure(ctx: Ctx, contenders: list[Contender], plan: ToolPlan, log: Callable[[str], None]) -> dict[str, Any]:
    """Run the tools phase; returns DataPlane.summary()'s shape, or {"error": why} when a tool is missing."""
    gone = missing()
    if gone:
        return {"error": "not installed: " + ", ".join(gone) + " (scripts/setup.sh installs them)"}
    servers = ToolServers(ctx)
    try:
        servers.start()
        tp = ToolPlane(ctx, contenders, plan, log)
        log(f"tools: {plan.rounds} rounds × {len(tp.contenders)} contenders, {plan.seconds} s per run")
        tp.run()
        return tp.summary()
    finally:
        servers.close()


def versions() -> dict[str, str]:
    """The first line of each tool's version output, for the results' metadata."""
    flags = {"wrk": ["-v"], "iperf3": ["-v"], "redis-benchmark": ["--version"], "nginx": ["-v"]}
    out = {}
    for tool, flag in flags.items():
        if shutil.which(tool) is None:
            continue
        r = subprocess.run([tool, *flag], capture_output=True, text=True)
        out[tool] = (r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr).strip() else "?"
    return out


__all__ = ["ToolPlan", "ToolPlane", "ToolServers", "measure", "missing", "versions"]
