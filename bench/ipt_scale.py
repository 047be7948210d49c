"""Scale benchmark of the iptables datapath (not a test): program N Services x 2 endpoints from
cold into a throwaway network namespace, then change one endpoint of one Service many times, with
iptables-nft and iptables-legacy.

    .venv/bin/python -m bench.ipt_scale [--sizes 1000,10000] [--changes 100] [--rounds 3]
                                        [--datapaths nft,legacy,nftables]

"nft" and "legacy" are the iptables datapath with that backend; "nftables" is the nftables
datapath, measured in the same run by bench/nft_scale.py's run_size (endpoints over 50 nodes).

Cold: the first read back (it installs the skeleton, as at an agent's start) and then one
IptablesDatapath.apply() of every ServicePort: rule generation in Python, one iptables-save and
one iptables-restore --noflush per family; the median (and max) of --rounds runs, each in a fresh
namespace. One change: apply() of one ServicePort whose second endpoint is replaced, a partial
sync as kube-proxy's (the filter table, the nat top-level chains and that ServicePort's chains,
the old KUBE-SEP chain deleted), measured end to end; p50 and p99 over --changes changes, with
how many lines each restore sent. Results go to bench/results/ipt_scale.json and are printed
as a table. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import platform
import secrets
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import NodeFacts
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName
from usproxy.offload.iptables.backend import Backend
from usproxy.offload.iptables.datapath import IptablesDatapath

RESULTS = Path(__file__).parent / "results"


def service(i: int, second: int, nodes: int = 50) -> tuple[ServicePortName, ServicePortState]:
    """Service i with endpoints 2i+2 and 2i+2+`second` (nodeNames spread over `nodes`)."""
    name = ServicePortName("bench", f"svc-{i}", "http", "TCP")
    vip = ipaddress.ip_address(int(ipaddress.ip_address("10.96.0.0")) + i + 1)
    base = int(ipaddress.ip_address("10.244.0.0")) + 2 * i + 2
    eps = tuple(Endpoint(ipaddress.ip_address(base + k), 8080, node_name=f"node-{(2 * i + k) % nodes}")
                for k in (0, second))
    sp = ServicePort(name=name, cluster_ips=(vip,), port=80, target_port=8080)
    return name, ServicePortState(sp, eps, eps, eps)


async def cold_once(ns: str, n: int, backend: Backend) -> tuple[float, IptablesDatapath]:
    dp = IptablesDatapath(netns=ns, node=NodeFacts("node-0"), backend=backend)
    assert dp.probe().available, dp.probe()
    await dp.read_back()  # as the agent's first full sync: the skeleton, before anything is offloaded
    states = dict(service(i, 1) for i in range(n))
    t0 = time.perf_counter()
    await dp.apply(states)
    return time.perf_counter() - t0, dp


async def run_size(ns: str, n: int, changes: int, backend: Backend, rounds: int = 1) -> dict[str, Any]:
    colds: list[float] = []
    for _ in range(rounds - 1):
        with scratch_netns() as other:
            cold, dp = await cold_once(other, n, backend)
            dp.close()
        colds.append(cold)
    cold, dp = await cold_once(ns, n, backend)
    colds.append(cold)
    try:
        fulls = dp.full_syncs
        one: list[float] = []
        lines: list[int] = []
        for k in range(changes):
            i = (k * 7919) % n
            name, st = service(i, 1 if k % 2 else 100_000 + k)
            t0 = time.perf_counter()
            await dp.apply({name: st})
            one.append(time.perf_counter() - t0)
            lines.append(dp.last_input[4].count("\n"))
        one.sort()
        assert dp.full_syncs == fulls, "a partial sync was refused: the figures include full ones"
        return {"backend": backend, "services": n, "endpoints_per_service": 2, "rounds": rounds,
                "cold_s": round(statistics.median(colds), 3), "cold_max_s": round(max(colds), 3),
                "one_change_p50_ms": round(statistics.median(one) * 1000, 1),
                "one_change_p99_ms": round(one[max(0, int(len(one) * 0.99) - 1)] * 1000, 1),
                "restore_lines_per_change": int(statistics.median(lines)), "changes": changes}
    finally:
        await dp.cleanup()
        dp.close()


@contextlib.contextmanager
def scratch_netns() -> Iterator[str]:
    ns = f"uspbench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--changes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--datapaths", default="nft,legacy,nftables")
    args = ap.parse_args()
    rows = []
    for datapath in args.datapaths.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            with scratch_netns() as ns:
                if datapath == "nftables":
                    from bench.nft_scale import run_size as nft_run_size

                    r = asyncio.run(nft_run_size(ns, n, args.changes, 50, args.rounds))
                    r["backend"], r["restore_lines_per_change"] = "nftables", 0
                else:
                    r = asyncio.run(run_size(ns, n, args.changes, datapath, args.rounds))
                rows.append(r)
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    meta = {"kernel": platform.release(), "python": platform.python_version(), "loadavg": load,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}
    (RESULTS / "ipt_scale.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{'backend':>7} {'services':>8} {'cold s':>7} {'max s':>6} {'1-change p50 ms':>16} {'p99 ms':>7} {'lines':>6}")
    for r in rows:
        print(f"{r['backend']:>7} {r['services']:>8} {r['cold_s']:>7} {r['cold_max_s']:>6} "
              f"{r['one_change_p50_ms']:>16} {r['one_change_p99_ms']:>7} {r['restore_lines_per_change']:>6}")


if __name__ == "__main__":
    main()
