"""Processes the bench starts: spawned in a netns, with a high fd limit, stopped by pid.

`Procs` remembers every process it started and `close()` ends each one by its own pid (never by
name). `cpu_seconds()` and `rss_bytes()` read /proc for the proxy under test.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
NOFILE = 262144  # wanted; without CAP_SYS_RESOURCE the hard limit (20000 here) is what we get
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _raise_nofile() -> None:
    # Root may raise the hard limit; 10k idle relayed flows need 20k descriptors in the relay.
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Procs:
    """Every process one bench run started."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen[bytes]] = []

    def spawn(self, ns: str | None, argv: list[str], *, log: Path | None = None, stdin: int | None = None,
              stdout: int | IO[bytes] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + argv
        out: int | IO[bytes] | None = stdout
        if out is None:
            out = log.open("ab") if log is not None else subprocess.DEVNULL
        p = subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=out, stderr=subprocess.STDOUT if log or stdout else subprocess.DEVNULL,
                             preexec_fn=_raise_nofile, env=env)
        self.live.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
        if p in self.live:
            self.live.remove(p)
        return p.returncode

    def close(self) -> None:
        for p in list(reversed(self.live)):
            self.stop(p, timeout=5.0)


def run_json(procs: Procs, ns: str, module: str, spec: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """Run `python -m module '<spec>'` in `ns`; returns its last JSON line."""
    p = procs.spawn(ns, [PYTHON, "-m", module, json.dumps(spec)], stdout=subprocess.PIPE)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.stop(p, signal.SIGKILL)
        raise TimeoutError(f"{module} {spec.get('op')} timed out")
    procs.stop(p)
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {spec.get('op')} failed (rc {p.returncode}): {out.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and its reaped children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def cpu_split(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def python_module(module: str, *args: str) -> list[str]:
    return [PYTHON, "-m", module, *args]


