"""Memory: RSS per idle relayed flow.

The client opens N connections through the contender to the server's HOLD port and keeps them
idle; the proxy's RSS (VmRSS, all its processes) is read before and after the flows exist, once
their descriptors are all open. Per flow = ΔRSS ÷ N. A warm-up batch first lets allocator arenas
and the flow table reach their steady shape. N is capped by the proxy's descriptor limit (two
per flow): without CAP_SYS_RESOURCE the hard RLIMIT_NOFILE here is 20,000, so "10k" is measured
as large as that limit allows and reported with its real N.
"""

from __future__ import annotations

import json
import resource
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.contenders import Contender, Ctx
from bench.procs import PYTHON, fd_count, rss_bytes

FD_MARGIN = 200


def _rss(c: Contender) -> int:
    return sum(rss_bytes(p) for p in c.pids())


def _fds(c: Contender) -> int:
    return sum(fd_count(p) for p in c.pids())


def max_flows(c: Contender) -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    n = max(0, (min(hard, 262144) - _fds(c) - FD_MARGIN) // 2)
    return min(n, c.max_conns) if c.max_conns else n


def hold(ctx: Ctx, c: Contender, n: int, timeout: float = 120.0) -> dict[str, Any]:
    """Open n idle flows through c; returns RSS before/after and the per-flow figure."""
    base_rss, base_fds = _rss(c), _fds(c)
    p = ctx.procs.spawn(ctx.topo.client, [PYTHON, "-m", "bench.clients", json.dumps({"op": "hold", "target": c.target, "n": n})],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline().decode()
        if not line.startswith("{"):
            raise RuntimeError(f"hold client failed: {line}{p.stdout.read().decode()[-500:]}")
        deadline = time.monotonic() + timeout
        while _fds(c) < base_fds + 2 * n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # let the last accepts and dials settle
        after_rss, after_fds = _rss(c), _fds(c)
        p.stdin.close()
        p.wait(timeout)
    finally:
        ctx.procs.stop(p)
    return {"flows": n, "rss_before": base_rss, "rss_after": after_rss, "fds_added": after_fds - base_fds,
            "bytes_per_flow": (after_rss - base_rss) / n}


def measure(ctx: Ctx, contenders: list[Contender], sizes: tuple[int, ...], log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in contenders:
        if not c.available or not c.pids():
            continue
        hold(ctx, c, 200)  # warm-up
        time.sleep(0.5)
        rows = []
        for n in sizes:
            n_eff = min(n, max_flows(c))
            r = hold(ctx, c, n_eff)
            r["asked"] = n
            rows.append(r)
            log(f"  memory {c.name}: {n_eff} idle flows: {r['bytes_per_flow'] / 1024:.2f} KiB/flow")
            time.sleep(1.0)
        out[c.name] = rows
    return out
