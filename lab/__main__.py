"""`python3 -m lab` (scripts/vm.sh): boot a lab machine and run a scenario, or a command, inside.

    vm.sh SCENARIO [--memory MiB] [--smp N] [--duration S] [--results DIR]
    vm.sh SCENARIO --run 'python -m pytest -q tests/offload -k ipvs'     the repository copied in, command run from it
    vm.sh build [amd64|arm64|all] [--fresh]                 build (or refresh) the cached root file systems
    vm.sh list

Scenarios: no-nftables, no-xtables, cgroup1, ipvs, edge-256, arm64 (lab/scenarios.py).
Exit status: 0 the scenario passed (or --run's command exited 0; its status otherwise), 1 it
failed or the lab could not run it, 2 bad usage. The last line of stdout is one JSON object:
scenario, the guest's uname -r and architecture, memory, the features found missing inside the
guest, the datapath each ServicePort landed on, the figures, wall times, and where the results
(console, agent log, dmesg, result.json) were kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab import debs, machine, rootfs
from lab.scenarios import SCENARIOS, Scenario
from lab.wheel import usproxy_wheel

REPO = rootfs.REPO
REPO_PARTS = ("usproxy", "tests", "lab", "examples", "demo", "bench", "pyproject.toml", "setup.py")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/vm.sh", description="boot a lab machine and run a scenario inside")
    p.add_argument("scenario", help=f"one of {', '.join(SCENARIOS)}; or 'build', 'list'")
    p.add_argument("arch", nargs="?", help="build: amd64, arm64 or all (default all)")
    p.add_argument("--memory", type=int, metavar="MiB", help="guest memory (default: the scenario's)")
    p.add_argument("--smp", type=int, metavar="N", help="vCPUs (default: the scenario's)")
    p.add_argument("--duration", type=float, metavar="S", help="edge-256: soak length in seconds (default 600)")
    p.add_argument("--offload", choices=["auto", "nftables", "bpf", "none"],
                   help="edge-256: the agent's --offload (default nftables: see docs/lab.md, The edge machine)")
    p.add_argument("--run", metavar="CMD", help="run CMD (sh -c) from a copy of the repository in the guest instead")
    p.add_argument("--results", type=Path, metavar="DIR", help="keep the guest's results here (default: a new /tmp dir)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up on the guest after S seconds")
    p.add_argument("--fresh", action="store_true", help="build: rebuild even when cached")
    return p.parse_args(argv)


def need_tools(arch: str) -> str | None:
    qemu = ["qemu-system-x86_64"] if arch == "amd64" else ["qemu-system-aarch64", "qemu-aarch64-static"]
    for tool in (*qemu, "debootstrap", "mkfs.ext4", "cpio", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} missing (bash scripts/setup.sh installs the lab's packages)"
    if os.geteuid() != 0:
        return "the lab builds root file systems with debootstrap: run it as root"
    return None


def params_for(s: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    return {"scenario": s.name, "arch": s.arch, "smp": args.smp or s.smp, "memory_mib": args.memory or s.memory_mib,
            "blacklist": list(s.blacklist), "cgroups": s.cgroups, "load_modules": list(s.load_modules),
            "duration_s": args.duration if args.duration is not None else s.soak_s, "run": args.run,
            "offload": args.offload or "nftables", "debs": list(s.debs)}


def params_sh(p: dict[str, Any]) -> str:
    return "".join(f"{k}='{v}'\n" for k, v in (("LAB_SCENARIO", p["scenario"]), ("LAB_CGROUPS", p["cgroups"]),
                                                ("LAB_LOAD_MODULES", " ".join(p["load_modules"])),
                                                ("LAB_REMOVE_MODULES", " ".join(p["blacklist"]))))


def run_scenario(s: Scenario, args: argparse.Namespace) -> int:
    start = time.monotonic()
    times: dict[str, float] = {}
    results = args.results or Path(tempfile.mkdtemp(prefix=f"usproxy-lab-{s.name}-"))
    summary: dict[str, Any] = {"scenario": s.name, "passed": False, "results": str(results)}
    try:
        t = time.monotonic()
        root = rootfs.ensure(s.arch)
        times["rootfs_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        wheel = usproxy_wheel()
        times["wheel_s"] = round(time.monotonic() - t, 1)
        p = params_for(s, args)
        with tempfile.TemporaryDirectory(prefix="usproxy-lab-in-") as tmp:
            members = input_members(Path(tmp), p, wheel)
            append = [f"lab.scenario={s.name}"]
            if s.blacklist:
                append.append("modprobe.blacklist=" + ",".join(s.blacklist))
            boot = machine.Boot(s.arch, p["smp"], p["memory_mib"], tuple(append),
                                args.timeout or s.timeout_s + float(p["duration_s"] or 0))
            out = machine.run(root, boot, members, results)
        times["boot_to_poweroff_s"] = out.wall_s
        summary.update(judge(s, args, out, results))
        summary.update({"accel": out.accel, "exit_reason": out.exit_reason, "kernel_package": root.info().get("kernel"),
                        "wheel": str(wheel)})
    except machine.Interrupted as sig:
        summary["error"] = f"interrupted by {sig}"
    except Exception as err:  # noqa: BLE001 - the lab failed: one line, in the JSON
        summary["error"] = f"{type(err).__name__}: {err}"
    times["wall_s"] = round(time.monotonic() - start, 1)
    summary["times"] = times
    line = json.dumps(summary, default=str)
    if results.is_dir():
        (results / "summary.json").write_text(line + "\n")
    print(line)
    if args.run:
        return int(summary.get("run_exit", 1))
    return 0 if summary["passed"] else 1


def input_members(tmp: Path, p: dict[str, Any], wheel: Path) -> dict[str, Path]:
    (tmp / "params.json").write_text(json.dumps(p))
    (tmp / "params.sh").write_text(params_sh(p))
    members = {"guest": Path(__file__).with_name("guest"), "params.json": tmp / "params.json",
               "params.sh": tmp / "params.sh", wheel.name: wheel}
    for deb in debs.fetch(tuple(p["debs"]), p["arch"]):
        members[f"debs/{deb.name}"] = deb
    if p["run"]:
        (tmp / "run.sh").write_text(p["run"] + "\n")
        members["run.sh"] = tmp / "run.sh"
        for part in REPO_PARTS:
            if (REPO / part).exists():
                members[f"repo/{part}"] = REPO / part
    return members


def judge(s: Scenario, args: argparse.Namespace, out: machine.Outcome, results: Path) -> dict[str, Any]:
    """The guest's verdict, trimmed to the summary's fields; a guest that wrote none failed."""
    guest = out.output
    if guest is None:
        return {"error": f"the guest wrote no results ({out.exit_reason}); console: {out.console}"}
    if args.run:
        log = (guest / "run.log").read_text(errors="replace") if (guest / "run.log").exists() else ""
        sys.stderr.write(log)
        rc = (guest / "run.rc").read_text().strip() if (guest / "run.rc").exists() else "1"
        return {"run": args.run, "run_exit": int(rc or 1), "passed": rc == "0", "output": str(guest / "run.log")}
    result_file = guest / "result.json"
    if not result_file.exists():
        tail = (guest / "scenario.log").read_text()[-1500:] if (guest / "scenario.log").exists() else ""
        return {"error": f"the scenario wrote no result.json ({out.exit_reason}): {tail}"}
    r = json.loads(result_file.read_text())
    keep = ("passed", "uname_r", "arch", "memory_kib", "vcpus", "missing", "datapaths", "expected", "figures",
            "failures", "pending", "iptables_datapath", "datapath_log", "check_disagrees", "bpf_object", "soak", "offload")
    summary = {k: r[k] for k in keep if k in r}
    summary["missing"] = {k: not v.get("present", True) for k, v in r.get("missing", {}).items()}
    summary["check"] = {c["name"]: c["available"] for c in r.get("check", [])}
    return summary


def cache_problem() -> str:
    """Why the root file systems' cache directory cannot be used ("": it can)."""
    try:
        rootfs.CACHE.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"USPROXY_LAB_CACHE {rootfs.CACHE}: cannot be made: {err.strerror}"
    if not os.access(rootfs.CACHE, os.W_OK | os.X_OK):
        return f"USPROXY_LAB_CACHE {rootfs.CACHE}: not a writable directory"
    return ""


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.scenario == "list":
        for s in SCENARIOS.values():
            print(f"{s.name:12} {s.arch}  {s.smp} vCPU  {s.memory_mib:5} MiB  {s.summary}")
        return 0
    if args.scenario == "build":
        arches = ["amd64", "arm64"] if args.arch in (None, "all") else [args.arch]
        for arch in arches:
            missing = need_tools(arch) or cache_problem()
            if missing:
                print(f"vm.sh: {missing}", file=sys.stderr)
                return 1
            t = time.monotonic()
            try:
                with machine.signals_raise():  # SIGTERM: the build's children stop, its directory goes
                    r = rootfs.ensure(arch, fresh=args.fresh)  # type: ignore[arg-type]
            except machine.Interrupted as sig:
                print(f"vm.sh: build interrupted by {sig}", file=sys.stderr)
                return 1
            print(json.dumps({"arch": arch, "rootfs": str(r.directory), "seconds": round(time.monotonic() - t, 1),
                              **r.info()}))
        return 0
    if args.scenario not in SCENARIOS:
        print(f"vm.sh: unknown scenario {args.scenario!r}; one of {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    s = SCENARIOS[args.scenario]
    missing = need_tools(s.arch) or cache_problem()
    if missing:
        print(f"vm.sh: {missing}", file=sys.stderr)
        print(json.dumps({"scenario": s.name, "passed": False, "error": missing}))
        return 1
    return run_scenario(s, args)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as err:
        print(f"vm.sh: {err}", file=sys.stderr)
        sys.exit(1)
