"""`usproxy tour`: the whole tour, mode after mode, then results.json and the plots.

The modes in the order Kubernetes got them: the relay (kube-proxy 1.0's userspace mode, usproxy's
own; `--offload none`), iptables, IPVS, nftables, BPF (Cilium's socket load balancer). A mode
runs when this usproxy has its datapath (usproxy/offload/registry.py) and the datapath's own
probe, as `usproxy check --json` reports it inside the tour's node namespace, says the kernel
has it; otherwise the results say which of the two is missing, with the probe's words.

Plans: QUICK (two sizes, 10 and 1,000 Services, shorter windows; under 3 minutes here) and FULL
(10, 1,000 and 10,000). A mode that fails is recorded with its error and the tour goes on; the
exit code is then 1. SIGTERM and SIGHUP end the tour as Ctrl-C does: what was started is
stopped and removed (network.TourNetwork.close), and what a killed tour left is removed by the
next one (network.sweep).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from usproxy.offload import registry
from usproxy.tour import plots, results
from usproxy.tour.network import TourNetwork, sweep
from usproxy.tour.results import ModeResult
from usproxy.tour.visit import MATCH_HOW, Plan, Visit
from usproxy.util.errors import ConfigError

QUICK = Plan(sizes=(10, 1000), rounds=3, window=0.3, conc=16, latency_count=100, changes=3, uniform_count=10_000)
FULL = Plan(sizes=(10, 1000, 10_000), rounds=3, window=0.6, conc=16, latency_count=300, changes=3,
            uniform_count=10_000)
MODES: tuple[tuple[str, str], ...] = (  # (mode, --offload), in the order Kubernetes got them
    ("relay", "none"), ("iptables", "iptables"), ("ipvs", "ipvs"), ("nftables", "nftables"), ("bpf", "bpf"))
MODE_NAMES = tuple(mode for mode, _ in MODES)
RELAY_WHY = "the relay, usproxy's own (kube-proxy 1.0's userspace mode): runs wherever usproxy runs"


def run(out: Path, plan: Plan, modes: Sequence[str] = MODE_NAMES, *,
        say: Callable[[str], None] = print, after: Callable[[Visit], None] | None = None) -> int:
    """The tour into `out`; 0 when every mode that this machine has was measured, else 1."""
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as err:  # one line naming --out, not a traceback
        raise ConfigError(f"cannot create: {err.strerror or err}", obj="usproxy tour", field=f"--out {out}") from None
    for left in sweep():
        say(f"removed what an interrupted tour left: {left}")
    started, load_before = time.monotonic(), os.getloadavg()
    net = TourNetwork()
    done: list[ModeResult] = []
    old = _signals_end_the_tour()
    try:
        net.open()
        checks = _checks(net)
        with tempfile.TemporaryDirectory(prefix="usproxy-tour-") as scratch:
            for mode, offload in MODES:
                if mode not in modes:
                    continue
                r = _prepared(mode, offload, checks)
                done.append(r)
                if not r.available:
                    say(f"{mode}: not measured: {r.why}")
                    continue
                say(f"{mode}: usproxy run --offload {offload}")
                try:
                    Visit(r, net, plan, Path(scratch), after, say).run()
                except Exception as err:
                    r.error = f"{type(err).__name__}: {err}"
                    say(f"{mode}: failed: {r.error}")
                finally:
                    _keep_log(r, out / "logs")
    finally:
        net.close()
        _restore(old)
    figures = plots.write_all(out, done, plan)
    tour = {"command": "usproxy tour" + (" --quick" if plan.sizes == QUICK.sizes else ""), "plan": _plan(plan),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.monotonic() - started, 1),
            "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_before": [round(x, 2) for x in load_before],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]}}
    path = results.write(out, results.document(tour, done, figures))
    say(f"results: {path}; plots: {', '.join(p.file for p in figures)} ({tour['seconds']:.0f} s)")
    failed = [r.mode for r in done if r.available and r.error]
    return 1 if failed else 0


def _prepared(mode: str, offload: str, checks: list[dict[str, Any]]) -> ModeResult:
    """The mode's record before its visit: whether it can run here, and why (not)."""
    if offload == "none":
        return ModeResult(mode, offload, True, RELAY_WHY, "userspace", MATCH_HOW[mode])
    cap = next((c for c in checks if c["name"] == mode or str(c["name"]).startswith(mode + " ")), None)
    probe = f"usproxy check: {cap['name']}: {cap['detail']}" if cap else "usproxy check has no probe for it"
    if offload not in registry.BY_NAME:
        return ModeResult(mode, offload, False, f"this usproxy has no {mode} datapath; {probe}", mode, MATCH_HOW[mode])
    if cap is None or not cap["available"]:
        return ModeResult(mode, offload, False, f"the kernel lacks it: {probe}", mode, MATCH_HOW[mode])
    return ModeResult(mode, offload, True, probe, mode, MATCH_HOW[mode])


def _checks(net: TourNetwork) -> list[dict[str, Any]]:
    """`usproxy check --json` in a fresh node namespace: every datapath's own probe."""
    net.build()
    try:
        res = subprocess.run(["nsenter", f"--net=/run/netns/{net.node}", "--", sys.executable, "-m", "usproxy",
                              "check", "--json"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "USPROXY_BPF_PINS": str(net.pin_root)})
        found: list[dict[str, Any]] = json.loads(res.stdout) if res.stdout.strip() else []
        return found
    finally:
        net.teardown()


def _keep_log(r: ModeResult, logs: Path) -> None:
    if r.agent_log and Path(r.agent_log).exists():
        kept = logs / Path(r.agent_log).name
        kept.write_bytes(Path(r.agent_log).read_bytes())
        r.agent_log = str(kept)


def _plan(plan: Plan) -> dict[str, Any]:
    return {"sizes": list(plan.sizes), "rounds": plan.rounds, "window_seconds": plan.window, "in_flight": plan.conc,
            "latency_connections": plan.latency_count, "changes_per_size": plan.changes,
            "uniformity_connections": plan.uniform_count}


class _Ended(KeyboardInterrupt):
    """SIGTERM or SIGHUP: ends the tour as Ctrl-C does, through every finally."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise _Ended(f"signal {signum}")


def _signals_end_the_tour() -> dict[int, Any]:
    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, _raise)
    return old


def _restore(old: dict[int, Any]) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)
