"""Scale benchmark of the nftables datapath (not a test): program N Services x 2 endpoints from
cold into a throwaway network namespace, then change one endpoint of one Service many times.

    .venv/bin/python bench/nft_scale.py [--sizes 1000,5000,10000] [--changes 200]

Cold: one NftablesDatapath.apply() of every ServicePort into an empty namespace (Python diff
generation + rendering + one libnftables transaction), and the libnftables call alone. One change:
apply() of one ServicePort whose second endpoint is replaced (a slot element deleted and added,
hairpin -1 +1), measured end to end; p50 and p99 over --changes rounds. Results go to
bench/results/nft_scale.json and are printed as a table. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import platform
import secrets
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from usproxy.datapath import ServicePortState
from usproxy.endpoint import Endpoint
from usproxy.offload.nftables import NftablesDatapath
from usproxy.offload.nftables_client import NftClient
from usproxy.offload.nftables_layout import Command
from usproxy.service_port import ServicePort
from usproxy.types import ServicePortName

RESULTS = Path(__file__).parent / "results"


class TimedClient(NftClient):
    """NftClient that records how long each libnftables call took."""

    last = 0.0

    async def apply(self, commands: Any) -> None:
        t0 = time.perf_counter()
        await super().apply(commands)
        self.last = time.perf_counter() - t0


def service(i: int, second: int) -> tuple[ServicePortName, ServicePortState]:
    name = ServicePortName("bench", f"svc-{i}", "http", "TCP")
    vip = ipaddress.ip_address(int(ipaddress.ip_address("10.96.0.0")) + i + 1)
    base = int(ipaddress.ip_address("10.244.0.0")) + 2 * i + 2
    eps = (Endpoint(ipaddress.ip_address(base), 8080), Endpoint(ipaddress.ip_address(base + second), 8080))
    sp = ServicePort(name=name, cluster_ips=(vip,), port=80, target_port=8080)
    return name, ServicePortState(sp, eps, eps, eps)


async def run_size(ns: str, n: int, changes: int) -> dict[str, Any]:
    client = TimedClient(ns)
    dp = NftablesDatapath(client, netns=ns)
    try:
        states = dict(service(i, 1) for i in range(n))
        t0 = time.perf_counter()
        await dp.apply(states)
        cold = time.perf_counter() - t0
        cold_nft = client.last
        one: list[float] = []
        for k in range(changes):
            i = (k * 7919) % n
            name, st = service(i, 1 if k % 2 else 100_000 + k)  # replace the second endpoint
            t0 = time.perf_counter()
            await dp.apply({name: st})
            one.append(time.perf_counter() - t0)
        one.sort()
        return {"services": n, "endpoints_per_service": 2, "cold_s": round(cold, 4), "cold_libnftables_s": round(cold_nft, 4),
                "one_change_p50_ms": round(statistics.median(one) * 1000, 3),
                "one_change_p99_ms": round(one[int(len(one) * 0.99) - 1] * 1000, 3), "rounds": changes}
    finally:
        await dp.cleanup()
        dp.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,5000,10000")
    ap.add_argument("--changes", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        ns = f"uspbench-{secrets.token_hex(3)}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            rows.append(asyncio.run(run_size(ns, n, args.changes)))
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
        print(json.dumps(rows[-1]))
    RESULTS.mkdir(exist_ok=True)
    meta = {"kernel": platform.release(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}
    (RESULTS / "nft_scale.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{'services':>8} {'cold s':>8} {'(libnft)':>9} {'1-change p50 ms':>16} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['services']:>8} {r['cold_s']:>8} {r['cold_libnftables_s']:>9} {r['one_change_p50_ms']:>16} {r['one_change_p99_ms']:>8}")


if __name__ == "__main__":
    main()
