"""Profile a relay under load with py-spy (issue 9 item 6).

py-spy samples the proxy process from outside (no change to it) while the bench client drives a
workload; the raw stacks are folded into self time per function (the leaf frame, with native
frames, so time inside uvloop's C code and in syscalls shows as such) and the share of samples
that were inside a system call.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from bench.contenders import Contender, Ctx
from bench.procs import ROOT, run_json

PY_SPY = str(ROOT / ".venv" / "bin" / "py-spy")


def available() -> str | None:
    if not Path(PY_SPY).exists() and shutil.which("py-spy") is None:
        return "py-spy is not installed (pip install py-spy into .venv)"
    return None


IDLE = {"epoll_pwait", "epoll_wait", "pthread_cond_wait", "pthread_cond_timedwait", "select", "poll", "__futex_abstimed_wait_common"}
SYSCALLS = {"read", "write", "writev", "readv", "splice", "recv", "send", "recvfrom", "sendto", "accept4", "connect",
            "socket", "close", "epoll_ctl", "ioctl", "setsockopt", "getsockopt", "getsockname", "getpeername", "shutdown",
            "pipe2", "fcntl", "brk", "mmap", "munmap", "syscall", "__close", "__libc_write", "__libc_read"}


def _fold(raw: str) -> list[dict[str, Any]]:
    """Self time per function as a share of the busy samples (waiting in epoll is not busy); the
    first rows summarise busy time inside system calls vs in user space."""
    self_counts: collections.Counter[str] = collections.Counter()
    total = idle = in_sys = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        # py-spy frames look like "function (file.py:line)"; keep the function and the file name
        name, _, where = leaf.partition(" (")
        where = where.rstrip(")").rsplit(":", 1)[0]
        if name in IDLE:
            idle += int(n)
            continue
        in_sys += int(n) if name in SYSCALLS else 0
        self_counts[f"{name} ({Path(where).name})" if where else name] += int(n)
        total += int(n)
    if not total:
        return []
    head = [{"function": "[busy share of samples]", "samples": total, "share": total / (total + idle)},
            {"function": "[busy: in system calls]", "samples": in_sys, "share": in_sys / total}]
    return head + [{"function": f, "samples": c, "share": c / total} for f, c in self_counts.most_common(15)]


def profile(ctx: Ctx, c: Contender, label: str, spec: dict[str, Any], seconds: float, work: Path) -> list[dict[str, Any]]:
    """Run `spec` against c while py-spy records c's main process for `seconds`."""
    pid = c.pids()[0]
    out = work / f"pyspy-{c.name}-{label}.txt"
    cmd = [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
           "--format", "raw", "--output", str(out), "--native"]
    spy: subprocess.Popen[bytes] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ctx.procs.live.append(spy)
    load = threading.Thread(target=run_json, args=(ctx.procs, ctx.topo.client, "bench.clients",
                                                  dict(spec, target=c.target, duration=seconds + 1.0)))
    load.start()
    try:
        _, err = spy.communicate(timeout=seconds + 60)
    finally:
        load.join()
        ctx.procs.stop(spy)
    if not out.exists():
        return [{"function": f"py-spy failed: {err.decode()[-200:]}", "samples": 0, "share": 0.0}]
    return _fold(out.read_text())
