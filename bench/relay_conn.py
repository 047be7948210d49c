"""Relay CPU per new connection beside HAProxy, both pinned to the same core (issue 30 item 3).

Each proxy's every thread is pinned to one CPU (PIN_CPU) for its turn, so the proxy works on one
core as HAProxy with `nbthread 1` does, and its CPU per connection is not spread over cores shared
with the client and the server (which stay unpinned). Per round, in a rotating order, each proxy
gets bench's short-connection load (`clients.conn`: c=64, 16 source addresses, 64 B each way, the
server closes first); its CPU (utime + stime from /proc, every thread) inside the client's window
is divided by the connections completed in it. Reported: medians over rounds of µs per connection
and of connections per second, and the per-round ratio to HAProxy.

`--baseline TREE` adds `relay-base`: the same agent run from another source tree (PYTHONPATH), in
the same rounds, so a before/after of the relay is measured under the same load. `--syscalls`
also counts system calls per connection of each proxy with `strace -c -f` over one window (strace
slows the proxy many times over: its rate and CPU are not the figures, only the counts are).

Standalone: `sudo .venv/bin/python -m bench.relay_conn [--rounds N] [--seconds S] [--baseline TREE]
[--syscalls] [--profile] [--stem NAME]`; `bench.run --only relayconn` runs it as a phase.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.contenders import Contender, Ctx
from bench.procs import cpu_split, run_json

RESULTS = Path(__file__).parent / "results"

PIN_CPU = 1 if (os.cpu_count() or 1) > 1 else 0
CONC = 64
KEYS = ("cps", "cpu_us_per_conn", "user_us_per_conn", "sys_us_per_conn", "errors")


def threads(pids: list[int]) -> list[int]:
    """Every thread id of `pids`."""
    out: list[int] = []
    for pid in pids:
        try:
            out += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
    return out


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of `pids` (those that exist now; new ones inherit it) on `cpus`."""
    for tid in threads(pids):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def _cpu(c: Contender) -> tuple[float, float]:
    """User and system CPU seconds of `c`'s processes (every thread's)."""
    user = system = 0.0
    for pid in c.pids():
        try:
            u, s = cpu_split(pid)
        except OSError:
            continue
        user, system = user + u, system + s
    return user, system


def one_window(ctx: Ctx, c: Contender, seconds: float, warmup: float | None) -> dict[str, float]:
    """The short-connection load against `c` for `seconds` after `warmup`; the proxy's CPU inside.
    `warmup` None: every connection of the client's run counts, from its first (for strace)."""
    start = time.monotonic() + (0.3 + warmup if warmup is not None else 0.0)  # the client starts in ~0.2 s
    end = start + seconds + (0.3 if warmup is None else 0.0)
    spec = {"op": "conn", "conc": CONC, "sources": ctx.topo.sources, "procs": 2, "target": c.target,
            "start": start, "end": end}
    marks: list[tuple[float, float]] = []

    def sample() -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        marks.append(_cpu(c))
        time.sleep(max(0.0, end - time.monotonic()))
        marks.append(_cpu(c))

    th = threading.Thread(target=sample)
    th.start()
    r = run_json(ctx.procs, ctx.topo.client, "bench.clients", spec, timeout=seconds + 60)
    th.join()
    conns = max(1, int(r["conns"]))
    user, system = ((b - a) / conns * 1e6 for a, b in zip(*marks))
    return {"cps": r["conns"] / r["seconds"], "cpu_us_per_conn": user + system, "user_us_per_conn": user,
            "sys_us_per_conn": system, "conns": r["conns"], "errors": r["errors"]}


def syscalls(ctx: Ctx, c: Contender, seconds: float, work: Path) -> dict[str, Any]:
    """System calls per connection of `c` (strace -c -f over one window)."""
    out = work / f"strace-{c.name}.txt"
    pid = c.pids()[0]
    spy = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx.procs.live.append(spy)
    try:
        time.sleep(0.5)  # attached before the client's first connection
        r = one_window(ctx, c, seconds, None)
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(30)
        finally:
            ctx.procs.stop(spy)
    calls = parse_strace(out.read_text() if out.exists() else "")
    n = max(1, int(r["conns"]))
    per = {k: round(v / n, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v / n >= 0.05}
    return {"conns": r["conns"], "per_conn": per, "total_per_conn": round(sum(calls.values()) / n, 1)}


STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def parse_strace(text: str) -> dict[str, int]:
    """`strace -c` table → calls per system call (futex waits of idle threads included: shown)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = STRACE_ROW.match(line)
        if m and m.group(2) != "total":
            out[m.group(2)] = int(m.group(1))
    return out


def measure(ctx: Ctx, contenders: list[Contender], rounds: int, seconds: float, warmup: float,
            log: Callable[[str], None], *, count_syscalls: bool = False) -> dict[str, Any]:
    """Interleaved rounds of every available contender with a process (HAProxy and the relays)."""
    procs = [c for c in contenders if c.available and c.pids()]
    samples: dict[str, dict[str, list[float]]] = {c.name: {k: [] for k in KEYS} for c in procs}
    ratios: dict[str, dict[str, list[float]]] = {}
    loads: list[list[float]] = []
    for rnd in range(rounds):
        order = procs[rnd % len(procs):] + procs[:rnd % len(procs)]
        got: dict[str, dict[str, float]] = {}
        loads.append(list(os.getloadavg()))
        for c in order:
            before = {tid: os.sched_getaffinity(tid) for tid in threads(c.pids())}
            pin(c.pids(), {PIN_CPU})
            try:
                got[c.name] = r = one_window(ctx, c, seconds, warmup)
            except (RuntimeError, TimeoutError, KeyError) as err:
                log(f"  relayconn round {rnd + 1} {c.name}: failed: {err}")
                continue
            finally:
                for tid, cpus in before.items():
                    try:
                        os.sched_setaffinity(tid, cpus)
                    except OSError:
                        pass
            for k in KEYS:
                samples[c.name][k].append(r[k])
        base = got.get("haproxy")
        for name, r in got.items():
            if base and name != "haproxy":
                rs = ratios.setdefault(name, {"cps": [], "cpu_us_per_conn": []})
                rs["cps"].append(r["cps"] / base["cps"])
                rs["cpu_us_per_conn"].append(r["cpu_us_per_conn"] / base["cpu_us_per_conn"])
        log(f"  relayconn round {rnd + 1}/{rounds}: " + " ".join(
            f"{n}={r['cpu_us_per_conn']:.0f}µs/{r['cps']:,.0f}cps" for n, r in got.items())
            + f" (load {loads[-1][0]:.1f})")
    out: dict[str, Any] = {
        "plan": {"rounds": rounds, "seconds": seconds, "warmup": warmup, "conc": CONC, "pinned_cpu": PIN_CPU},
        "samples": samples, "load_avg_1_5_15": loads,
        "median": {n: {k: statistics.median(v) for k, v in s.items() if v} for n, s in samples.items()},
        "ratio_vs_haproxy": {n: {k: statistics.median(v) for k, v in s.items() if v} for n, s in ratios.items()},
    }
    if count_syscalls:
        out["syscalls"] = {}
        for c in procs:
            log(f"  relayconn: strace -c on {c.name}")
            pin(c.pids(), {PIN_CPU})
            out["syscalls"][c.name] = syscalls(ctx, c, 3.0, ctx.work)
            pin(c.pids(), set(range(os.cpu_count() or 1)))
    return out


def table(d: dict[str, Any]) -> list[str]:
    """Markdown rows of one `measure` result."""
    names = list(d["median"])
    lines = ["| proxy (pinned to CPU %d, c=%d) | µs CPU per connection (user + sys) | conn/s | ÷ HAProxy conn/s "
             "| ÷ HAProxy CPU |" % (d["plan"]["pinned_cpu"], d["plan"]["conc"]), "|---|---:|---:|---:|---:|"]
    for n in names:
        m, r = d["median"][n], d["ratio_vs_haproxy"].get(n, {})
        ratios = f"{r['cps']:.2f} | {r['cpu_us_per_conn']:.2f}" if r else "– | –"
        lines.append(f"| {n} | {m.get('cpu_us_per_conn', 0):.0f} ({m.get('user_us_per_conn', 0):.0f} + "
                     f"{m.get('sys_us_per_conn', 0):.0f}) | {m.get('cps', 0):,.0f} | {ratios} |")
    loads = [x[0] for x in d["load_avg_1_5_15"]]
    lines.append(f"\nMedians of {d['plan']['rounds']} interleaved rounds of {d['plan']['seconds']} s; "
                 f"1-min load average {min(loads):.1f}–{max(loads):.1f} during the rounds.")
    for n, s in d.get("syscalls", {}).items():
        lines.append(f"- {n}: {s['total_per_conn']} system calls per connection: "
                     + ", ".join(f"{k} {v}" for k, v in s["per_conn"].items()))
    return lines


def main() -> int:
    from bench.contenders import HAProxy, Usproxy
    from bench.procs import PYTHON, Procs
    from bench.topology import BenchTopology

    ap = argparse.ArgumentParser(prog="python -m bench.relay_conn", description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--baseline", type=Path, help="a source tree whose usproxy runs as relay-base")
    ap.add_argument("--syscalls", action="store_true", help="also count system calls per connection (strace -c)")
    ap.add_argument("--stem", default=time.strftime("%Y-%m-%d") + "-relayconn")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench needs root (network namespaces)", flush=True)
        return 2
    topo, procs = BenchTopology(), Procs()
    work = Path(tempfile.mkdtemp(prefix="usproxy-relayconn-"))
    ctx = Ctx(topo, procs, work)
    contenders: list[Contender] = [Usproxy("relay", "10.96.100.10", 1), HAProxy("10.96.200.10")]
    if args.baseline:
        contenders.append(Usproxy("relay-base", "10.96.104.10", 4, pythonpath=str(args.baseline.resolve())))
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    result: dict[str, Any] = {}
    try:
        topo.build()
        for ns, name in ((topo.server, "srv"), (topo.server2, "srv2")):
            p = procs.spawn(ns, [PYTHON, "-m", "bench.servers", name], stdout=subprocess.PIPE)
            assert p.stdout is not None
            p.stdout.readline()
        for c in contenders:
            c.start(ctx)
            log(f"contender {c.name}: " + ("up" if c.available else f"unavailable: {c.reason}"))
        result = measure(ctx, contenders, args.rounds, args.seconds, args.warmup, log, count_syscalls=args.syscalls)
    finally:
        for c in contenders:
            c.stop(ctx)
        procs.close()
        topo.close()
        shutil.rmtree(work, ignore_errors=True)
    result["meta"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "baseline": str(args.baseline or ""),
                      "command": "sudo .venv/bin/python -m bench.relay_conn " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    md = "\n".join(table(result))
    (RESULTS / f"{args.stem}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
