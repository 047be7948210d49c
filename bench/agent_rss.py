"""Idle agent RSS: a relay-only agent with N static-manifest Services, measured once it is idle.

The row "idle agent RSS, static manifests, 100 Services, relay only" of issue 17. Each Service has
the bench's shape (contenders.service_manifest: 7 TCP + 2 UDP ports, one endpoint), so 100
Services are 900 relay listeners. Per round a throwaway netns is made, `python -m usproxy run
--services DIR --offload none` starts in it, and the agent's VmRSS is read `--settle` seconds
(default 5) after /healthz first reports a completed sync; the agent is then stopped and the
netns deleted. The figure is the median over `--rounds` (default 3). Each round also records
smaps_rollup's anonymous and file-backed shares, which say whether a saving is the heap's or
the mapped code's.

Run as root from a checkout: `PYTHONPATH=$PWD .venv/bin/python -m bench.agent_rss [--services 100]`.
The code measured is the `usproxy` package the interpreter imports (PYTHONPATH), so a second
checkout can be measured with `--pythonpath`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.contenders import service_manifest, write_manifests
from bench.topology import inside

HEALTHZ = "127.0.0.1:10356"
METRICS = "127.0.0.1:10349"


def _sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True)


def services(n: int) -> list[dict[str, Any]]:
    """n Services of the bench's shape, ClusterIPs 10.96.<i/250>.<i%250+1>, endpoint 10.244.0.5."""
    objs: list[dict[str, Any]] = []
    for i in range(n):
        objs += service_manifest(f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}", "10.244.0.5")
    return objs


def _synced(ns: str) -> bool:
    try:
        with inside(ns):
            with urllib.request.urlopen(f"http://{HEALTHZ}/healthz", timeout=2) as r:
                body = json.loads(r.read())
    except OSError:
        return False
    return not str(body.get("lastUpdated", "0001-")).startswith("0001-")


def smaps(pid: int) -> dict[str, int]:
    """VmRSS and smaps_rollup's Anonymous / Rss in bytes (file-backed = Rss - Anonymous)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1]) * 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Anonymous"):
            out[key.lower()] = int(rest.split()[0]) * 1024
    out["file"] = out["rss"] - out["anonymous"]
    return out


def one_round(n: int, settle: float, pythonpath: str, env_extra: dict[str, str]) -> dict[str, Any]:
    ns = "usprss" + secrets.token_hex(3)
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        with tempfile.TemporaryDirectory(prefix="usprss") as d:
            write_manifests(Path(d), services(n))
            env = dict(os.environ, PYTHONPATH=pythonpath, USPROXY_EVENT_LOOP="uvloop", **env_extra)
            argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "usproxy", "run", "--services", d,
                    "--offload", "none", "--healthz-bind-address", HEALTHZ,
                    "--metrics-bind-address", METRICS, "--vip-interface", "usprss0"]
            with open(Path(d) / "agent.log", "w") as logf:
                # cwd: `-m` puts it first on sys.path, and the package measured is PYTHONPATH's
                proc = subprocess.Popen(argv, env=env, cwd=d, stdout=logf, stderr=subprocess.STDOUT)
            try:
                t0 = time.monotonic()
                while not _synced(ns):
                    if proc.poll() is not None or time.monotonic() - t0 > 120:
                        raise RuntimeError("agent did not sync: " + (Path(d) / "agent.log").read_text()[-1500:])
                    time.sleep(0.05)
                synced = time.monotonic() - t0
                time.sleep(settle)
                r: dict[str, Any] = {"sync_s": round(synced, 2), **smaps(proc.pid)}
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            return r
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--pythonpath", default=os.environ.get("PYTHONPATH", os.getcwd()))
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the agent")
    a = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.env)
    rounds = [one_round(a.services, a.settle, a.pythonpath, extra) for _ in range(a.rounds)]
    for r in rounds:
        print(json.dumps(r))
    mib = statistics.median(r["rss"] for r in rounds) / 2**20
    anon = statistics.median(r["anonymous"] for r in rounds) / 2**20
    print(f"idle agent RSS, {a.services} Services, relay only: median {mib:.1f} MiB "
          f"(anonymous {anon:.1f} MiB) over {a.rounds} rounds")


if __name__ == "__main__":
    main()
