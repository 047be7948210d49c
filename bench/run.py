"""The one command: `sudo .venv/bin/python -m bench.run [--quick]` from the repository root.

Builds the bench netns (topology.py), starts the bench servers and every contender
(contenders.py), runs the data plane in interleaved rounds (dataplane.py), the relay's CPU per
new connection beside HAProxy on one pinned core (relay_conn.py), profiles the relay
(profile.py), runs the real tools through the same contenders (tools.py), measures memory per
idle flow (memory.py), the control plane (controlplane.py) and the control plane end to end,
from spawn and from an edit (startup.py), then writes bench/results/<date>[-quick].{json,md} and PNG charts (report.py) and prints the
markdown. Everything it created (netns, processes, nft tables: they live in its netns) is removed
on exit, also on failure and Ctrl-C. `--quick`: small sizes, 2 rounds, about 3 minutes;
default (full): 1 GiB transfers, 4 rounds, 1k/5k/10k Services, about 20 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from bench import controlplane, memory, profile, relay_conn, report, startup, tools
from bench.contenders import Contender, Ctx, Usproxy, default_contenders
from bench.dataplane import DataPlane, Plan
from bench.procs import PYTHON, Procs
from bench.topology import BenchTopology

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def machine() -> str:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} × {cpu}, Linux {platform.release()}, Python {platform.python_version()}"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 rounds, about 3 minutes")
    ap.add_argument("--rounds", type=int, help="data-plane rounds (default 2 quick, 4 full)")
    ap.add_argument("--only", default="dataplane,relayconn,tools,profile,memory,controlplane,startup",
                    help="comma list of phases: dataplane, relayconn, tools, profile, memory, controlplane, startup")
    ap.add_argument("--prototypes", action=argparse.BooleanOptionalAction, default=None,
                    help="include the relay prototypes of bench/prototypes (default: full runs only)")
    ap.add_argument("--stem", help="results file name (default <date>[-quick])")
    ap.add_argument("--update", metavar="STEM", help="re-run only --only's phases and replace them in results/STEM.json")
    ap.add_argument("--offloaded", default="nftables", choices=["nftables", "iptables", "bpf"],
                    help="the kernel datapath of the 'offloaded' contender (default nftables)")
    ap.add_argument("--baseline", type=Path, metavar="TREE",
                    help="also run the agent from another source tree as relay-base (a before/after in the same rounds)")
    return ap.parse_args()


def _interrupt(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    args = parse()
    if os.geteuid() != 0:
        print("bench needs root (network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    phases = set(args.only.split(","))
    quick = args.quick
    protos = args.prototypes if args.prototypes is not None else not quick
    plan = Plan(rounds=args.rounds or (2 if quick else 4), bulk_bytes=(256 << 20) if quick else (1 << 30),
                duration=0.8 if quick else 2.5, warmup=0.3 if quick else 0.5)
    cp_sizes = (1000,) if quick else (1000, 5000, 10000)
    stem = args.stem or datetime.date.today().isoformat() + ("-quick" if quick else "")
    command = "sudo .venv/bin/python -m bench.run " + " ".join(sys.argv[1:])
    results: dict[str, Any] = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                                        "mode": "quick" if quick else "full", "rounds": plan.rounds, "command": command,
                                        "git": _git_head()}}
    if args.update:
        old = json.loads((report.RESULTS / f"{args.update}.json").read_text())
        old["meta"].setdefault("updated", []).append({"phases": sorted(phases), "date": results["meta"]["date"]})
        results = {**old, "meta": old["meta"]}
        stem = args.update
    topo, procs = BenchTopology(), Procs()
    work = Path(tempfile.mkdtemp(prefix="usproxy-bench-"))
    contenders: list[Contender] = []
    ctx = Ctx(topo, procs, work)
    try:
        log(f"building netns {topo.node} ...")
        topo.build()
        for ns, name in ((topo.server, "srv"), (topo.server2, "srv2")):
            p = procs.spawn(ns, [PYTHON, "-m", "bench.servers", name], stdout=subprocess.PIPE)
            assert p.stdout is not None
            p.stdout.readline()
        contenders = default_contenders(protos, args.offloaded)
        results["meta"]["offloaded"] = args.offloaded
        if args.baseline:
            contenders.append(Usproxy("relay-base", "10.96.104.10", 4, pythonpath=str(args.baseline.resolve())))
        for c in contenders:
            c.start(ctx)
            log(f"contender {c.name}: " + ("up" if c.available else f"unavailable: {c.reason}"))
        if not args.update or "dataplane" in phases:  # the contenders of the data plane just run
            results["contenders"] = [c.describe() for c in contenders]
            results["unavailable"] = {c.name: c.reason for c in contenders if not c.available}
        by_name = {c.name: c for c in contenders if c.available}
        if "dataplane" in phases:
            log(f"data plane: {plan.rounds} rounds × {len(by_name)} contenders")
            dp = DataPlane(ctx, contenders, plan, log)
            dp.run()
            results["dataplane"] = dp.summary()
        if "relayconn" in phases:
            pinned = [by_name[n] for n in ("relay", "haproxy", "relay-base") if n in by_name]
            log(f"relay CPU per connection, pinned to CPU {relay_conn.PIN_CPU}: {plan.rounds * 2 - 1} rounds")
            results["relayconn"] = relay_conn.measure(ctx, pinned, plan.rounds * 2 - 1, 1.0 if quick else 3.0,
                                                      plan.warmup, log, count_syscalls=True)
        if "tools" in phases:
            tplan = tools.ToolPlan(rounds=args.rounds or (2 if quick else 4), seconds=2 if quick else 5,
                                   redis_requests=20000 if quick else 100000)
            results["meta"]["tools"] = tools.versions()
            results["tools"] = tools.measure(ctx, contenders, tplan, log)
        if "profile" in phases and profile.available() is None:
            results["profile"] = _profiles(ctx, by_name, 2.0 if quick else 5.0, work)
        if "memory" in phases:
            log("memory per idle flow")
            targets = [by_name[n] for n in ("relay", "haproxy", "proto-splice") if n in by_name]
            results["memory"] = memory.measure(ctx, targets, (1000,) if quick else (1000, 10000), log)
        for c in contenders:
            c.stop(ctx)
        if "controlplane" in phases:
            log("control plane")
            results["controlplane"] = controlplane.measure(
                ctx, cp_sizes, changes=20 if quick else 50, kp_changes=5 if quick else 10,
                edit_repeats=3 if quick else 10, relay_sizes=(1000,) if quick else (1000, 5000), log=log)
        if "startup" in phases:
            log("control plane end to end (from spawn, from an edit)")
            results["startup"] = startup.measure(ctx.procs, ctx.topo, ctx.work, cp_sizes, 1 if quick else 3,
                                                 5 if quick else 20, log)
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        results["meta"]["interrupted"] = True
    finally:
        for c in contenders:
            try:
                c.stop(ctx)
            except Exception as err:  # cleanup goes on whatever one contender does
                log(f"stopping {c.name}: {err}")
        procs.close()
        topo.close()
        shutil.rmtree(work, ignore_errors=True)
    results["meta"].setdefault("seconds", round(time.monotonic() - T0, 1))
    jp, mp, pngs = report.write(results, stem)
    print(mp.read_text())
    log(f"wrote {jp}, {mp}, " + ", ".join(str(p) for p in pngs))
    return 130 if results["meta"].get("interrupted") else 0


def _profiles(ctx: Ctx, by_name: dict[str, Contender], seconds: float, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("relay", "proto-splice"):
        c = by_name.get(name)
        if c is None or not c.pids():
            continue
        for label, spec in (("bulk", {"op": "bulk", "bytes": 8 << 30}), ("rr c=16", {"op": "rr", "conc": 16}),
                            ("conn", {"op": "conn", "conc": 64, "sources": ctx.topo.sources, "procs": 2})):
            log(f"profiling {name} under {label} ({seconds:.0f}s)")
            out[f"{name} {label}"] = profile.profile(ctx, c, label.replace(" ", "").replace("=", ""), spec, seconds, work)
    return out


def _git_head() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    return r.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
