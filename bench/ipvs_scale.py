"""Scale benchmark of the IPVS datapath (not a test), with the iptables and nftables datapaths in
the same run: program N Services x 2 endpoints from cold into a throwaway network namespace, then
change one endpoint of one Service many times.

    python -m bench.ipvs_scale [--sizes 1000,10000] [--changes 100] [--rounds 1] [--datapaths ipvs,nft,nftables]

Only where IPVS is (this project's machines have none): the VM lab's ipvs guest, e.g.
`bash scripts/vm.sh ipvs --run 'python -m bench.ipvs_scale --sizes 1000 --changes 50'`. The guest
runs under TCG, an emulator: its absolute figures say nothing about a real node; compare the
datapaths with each other, measured in one run on one machine.

Cold: IpvsDatapath.apply() of every ServicePort into an empty namespace (kube-ipvs0, the sets, N
virtual servers and 2N real servers over netlink, one ipset restore, the iptables rules). One
change: apply() of one ServicePort whose second endpoint is replaced (a real server added, one
removed, no other virtual server touched), end to end; p50 and p99. "nft" is the iptables datapath
with iptables-nft (bench/ipt_scale.py), "nftables" the nftables datapath (bench/nft_scale.py).
Results print as JSON lines and a table (a guest's files do not come back: the lab keeps its
stdout in the run's results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from typing import Any

from bench.ipt_scale import scratch_netns, service
from usproxy.model.node import NodeFacts
from usproxy.offload.ipvs.datapath import IpvsDatapath


async def cold_once(ns: str, n: int) -> tuple[float, IpvsDatapath]:
    dp = IpvsDatapath(netns=ns, node=NodeFacts("node-0"))
    assert dp.probe().available, dp.probe()
    await dp.read_back()
    states = dict(service(i, 1) for i in range(n))
    t0 = time.perf_counter()
    await dp.apply(states)
    return time.perf_counter() - t0, dp


async def run_size(ns: str, n: int, changes: int, rounds: int = 1) -> dict[str, Any]:
    colds: list[float] = []
    for _ in range(rounds - 1):
        with scratch_netns() as other:
            cold, dp = await cold_once(other, n)
            dp.close()
        colds.append(cold)
    cold, dp = await cold_once(ns, n)
    colds.append(cold)
    try:
        one: list[float] = []
        for k in range(changes):
            i = (k * 7919) % n
            name, st = service(i, 1 if k % 2 else 100_000 + k)
            t0 = time.perf_counter()
            await dp.apply({name: st})
            one.append(time.perf_counter() - t0)
        one.sort()
        return {"backend": "ipvs", "services": n, "endpoints_per_service": 2, "rounds": rounds,
                "cold_s": round(statistics.median(colds), 3), "cold_max_s": round(max(colds), 3),
                "one_change_p50_ms": round(statistics.median(one) * 1000, 1),
                "one_change_p99_ms": round(one[max(0, int(len(one) * 0.99) - 1)] * 1000, 1), "changes": changes}
    finally:
        await dp.cleanup()
        dp.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--changes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--datapaths", default="ipvs,nft,nftables")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for datapath in args.datapaths.split(","):
            with scratch_netns() as ns:
                try:
                    r = one_run(ns, datapath, n, args.changes, args.rounds)
                except Exception as err:  # one datapath failing (nftables on the guest's kernel) keeps the others' rows
                    print(json.dumps({"backend": datapath, "services": n, "error": str(err)[:300]}), flush=True)
                    continue
                rows.append({k: r[k] for k in ("backend", "services", "cold_s", "cold_max_s", "one_change_p50_ms",
                                               "one_change_p99_ms", "changes", "rounds")})
            print(json.dumps(rows[-1]), flush=True)
    _report(rows)


def one_run(ns: str, datapath: str, n: int, changes: int, rounds: int) -> dict[str, Any]:
    """One datapath's row: ipvs, nftables, or the iptables datapath with backend `datapath`."""
    if datapath == "ipvs":
        return asyncio.run(run_size(ns, n, changes, rounds))
    if datapath == "nftables":
        from bench.nft_scale import run_size as nft_run_size

        return {**asyncio.run(nft_run_size(ns, n, changes, 50, rounds)), "backend": "nftables"}
    from bench.ipt_scale import run_size as ipt_run_size

    return {**asyncio.run(ipt_run_size(ns, n, changes, datapath, rounds)), "backend": f"iptables-{datapath}"}  # type: ignore[arg-type]


def _report(rows: list[dict[str, Any]]) -> None:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(json.dumps({"kernel": platform.release(), "loadavg": load, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}))
    print(f"{'datapath':>14} {'services':>8} {'cold s':>7} {'1-change p50 ms':>16} {'p99 ms':>7}")
    for r in rows:
        print(f"{r['backend']:>14} {r['services']:>8} {r['cold_s']:>7} {r['one_change_p50_ms']:>16} {r['one_change_p99_ms']:>7}")


if __name__ == "__main__":
    main()
