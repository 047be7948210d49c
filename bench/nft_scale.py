"""Scale benchmark of the nftables datapath (not a test): program N Services x 2 endpoints from
cold into a throwaway network namespace, then change one endpoint of one Service many times.

    .venv/bin/python bench/nft_scale.py [--sizes 1000,5000,10000] [--changes 200] [--rounds 5]
                                        [--nodes 1,50]

Cold: one NftablesDatapath.apply() of every ServicePort into an empty namespace (Python diff
generation + rendering + one libnftables transaction), and the libnftables call alone, after the
capability probe that loads libnftables (as the agent's start does). Each cold figure is the
median (and max) of --rounds runs, each in a fresh namespace: this VM's timings vary by a
fifth from run to run.

--nodes: the endpoints' nodeNames are spread over that many nodes and the datapath runs as one of
them. 1: every endpoint is on this node, so every endpoint gets a hairpin element (the worst
case, and what endpoints without a nodeName cost); 50: what one node of a 50-node cluster
programs (endpoints on other nodes get no hairpin element, see nftables/rules.py port_rules).

One change: apply() of one ServicePort whose second endpoint is replaced (a slot element deleted
and added, hairpin -1 +1), measured end to end; p50 and p99 over --changes rounds. Results go to
bench/results/nft_scale.json and are printed as a table. Needs root.
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
from usproxy.offload.nftables.client import NftClient
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.rules import _TEXT
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName

RESULTS = Path(__file__).parent / "results"


class TimedClient(NftClient):
    """NftClient that records how long each libnftables call took."""

    last = 0.0

    async def apply(self, commands: Any) -> None:
        t0 = time.perf_counter()
        await super().apply(commands)
        self.last = time.perf_counter() - t0


def service(i: int, second: int, nodes: int = 1) -> tuple[ServicePortName, ServicePortState]:
    name = ServicePortName("bench", f"svc-{i}", "http", "TCP")
    vip = ipaddress.ip_address(int(ipaddress.ip_address("10.96.0.0")) + i + 1)
    base = int(ipaddress.ip_address("10.244.0.0")) + 2 * i + 2
    eps = tuple(Endpoint(ipaddress.ip_address(base + k), 8080, node_name=f"node-{(2 * i + k) % nodes}")
                for k in (0, second))
    sp = ServicePort(name=name, cluster_ips=(vip,), port=80, target_port=8080)
    return name, ServicePortState(sp, eps, eps, eps)


async def cold_once(ns: str, n: int, nodes: int) -> tuple[float, float, NftablesDatapath, TimedClient]:
    """Program n Services into the empty namespace `ns`: (seconds, libnftables seconds, datapath)."""
    _TEXT.clear()  # the address-text cache starts empty in a starting agent too
    client = TimedClient(ns)
    dp = NftablesDatapath(client, netns=ns, node=NodeFacts("node-0"))
    dp.probe()  # as the agent: capabilities are probed (and libnftables loaded) before the first sync
    states = dict(service(i, 1, nodes) for i in range(n))
    t0 = time.perf_counter()
    await dp.apply(states)
    return time.perf_counter() - t0, client.last, dp, client


async def run_size(ns: str, n: int, changes: int, nodes: int = 1, rounds: int = 1) -> dict[str, Any]:
    """Cold (median of `rounds`, each but the last in its own scratch namespace) and one change."""
    colds: list[tuple[float, float]] = []
    for _ in range(rounds - 1):
        with scratch_netns() as other:
            cold, nft, dp, _ = await cold_once(other, n, nodes)
            dp.close()
        colds.append((cold, nft))
    cold, nft, dp, _ = await cold_once(ns, n, nodes)
    colds.append((cold, nft))
    try:
        one: list[float] = []
        for k in range(changes):
            i = (k * 7919) % n
            name, st = service(i, 1 if k % 2 else 100_000 + k, nodes)  # replace the second endpoint
            t0 = time.perf_counter()
            await dp.apply({name: st})
            one.append(time.perf_counter() - t0)
        one.sort()
        hairpin = len(dp.tables[4].hairpin)
        return {"services": n, "endpoints_per_service": 2, "nodes": nodes, "hairpin_elements": hairpin,
                "rounds": rounds, "cold_s": round(statistics.median(c for c, _ in colds), 4),
                "cold_max_s": round(max(c for c, _ in colds), 4),
                "cold_libnftables_s": round(statistics.median(x for _, x in colds), 4),
                "one_change_p50_ms": round(statistics.median(one) * 1000, 3),
                "one_change_p99_ms": round(one[int(len(one) * 0.99) - 1] * 1000, 3), "changes": changes}
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
    ap.add_argument("--sizes", default="1000,5000,10000")
    ap.add_argument("--changes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nodes", default="1,50")
    args = ap.parse_args()
    rows = []
    for nodes in (int(x) for x in args.nodes.split(",")):
        for n in (int(x) for x in args.sizes.split(",")):
            with scratch_netns() as ns:
                rows.append(asyncio.run(run_size(ns, n, args.changes, nodes, args.rounds)))
            print(json.dumps(rows[-1]))
    RESULTS.mkdir(exist_ok=True)
    meta = {"kernel": platform.release(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}
    (RESULTS / "nft_scale.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{'nodes':>5} {'services':>8} {'hairpin':>8} {'cold s':>8} {'max s':>7} {'(libnft)':>9} "
          f"{'1-change p50 ms':>16} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['services']:>8} {r['hairpin_elements']:>8} {r['cold_s']:>8} {r['cold_max_s']:>7} "
              f"{r['cold_libnftables_s']:>9} {r['one_change_p50_ms']:>16} {r['one_change_p99_ms']:>8}")


if __name__ == "__main__":
    main()
