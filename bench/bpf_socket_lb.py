"""Bench: the BPF socket LB against the direct path (client -> pod), as ratios to direct.

Builds a throwaway topology (netns node, a pod running bench.servers, a client), a test cgroup
and a BpfDatapath with throwaway pins; a Service 10.96.50.1 maps the bench ports to the pod. Each
round runs every measurement for `direct` (client outside the cgroup, dialling the pod IP) and
`bpf` (client inside the cgroup, dialling the ClusterIP), interleaved; the report gives medians
and bpf/direct ratios. After connect() the socket LB is out of the way, so bulk and rr should be
~1.0; conn shows the per-connect cost of the hook and udp the per-datagram cost (sendmsg and
recvmsg hooks on an unconnected socket). The client's CPU time per unit is reported as well: it
is less disturbed by other load than wall-clock rates. Everything is removed at exit.

  sudo .venv/bin/python -m bench.bpf_socket_lb [--rounds 5] [--mib 256] [--out bench/results/bpf.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.netns import Topology
from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.model.service_port import ServicePort
from usproxy.model.types import Protocol, ServicePortName
from usproxy.util import cgroup2

ROOT = Path(__file__).resolve().parents[1]
CLIENT = str(Path(__file__).with_name("bpf_client.py"))
POD, VIP = "10.244.1.10", "10.96.50.1"
PORTS: list[tuple[str, int, Protocol]] = [("bulk", 5001, "TCP"), ("rr", 5002, "TCP"), ("conn", 5003, "TCP"),
                                          ("udp", 5004, "UDP")]


def _states() -> dict[ServicePortName, ServicePortState | None]:
    out: dict[ServicePortName, ServicePortState | None] = {}
    for name, port, proto in PORTS:
        spn = ServicePortName("bench", "target", name, proto)
        sp = ServicePort(spn, (ipaddress.ip_address(VIP),), port, port)
        eps = (Endpoint(ipaddress.ip_address(POD), port),)
        out[spn] = ServicePortState(sp, eps, eps, eps)
    return out


@contextlib.contextmanager
def _setup() -> Iterator[tuple[Topology, Path, str]]:
    topo, token = Topology(), secrets.token_hex(4)
    cg = cgroup2.mount_point() / f"usproxy-bench-{token}"
    dp = BpfDatapath(cg, loader.BPFFS / f"usproxy-bench-{token}")
    server = None
    try:
        topo.build_node()
        pod = topo.add_host("pod", POD)
        cli = topo.add_host("cli", "10.244.9.10")
        server = subprocess.Popen(["ip", "netns", "exec", pod, sys.executable, "-m", "bench.servers", "pod"],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        cg.mkdir()
        asyncio.run(dp.apply(_states()))
        yield topo, cg, cli
    finally:
        if server is not None:
            server.kill()
            server.wait()
        asyncio.run(dp.cleanup())
        topo.close()
        with contextlib.suppress(OSError):
            cg.rmdir()


def _run(cg: Path | None, ns: str, what: str, host: str, amount: int) -> dict[str, Any]:
    cmd = f"exec ip netns exec {ns} {sys.executable} {CLIENT} {what} {host} {amount}"
    if cg is not None:
        cmd = f"echo $$ > {cg}/cgroup.procs && " + cmd
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=600, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(rounds: int, mib: int, conns: int, rrs: int) -> dict[str, Any]:
    amounts = {"bulk": mib, "conn": conns, "rr": rrs, "udp": rrs}
    rates: dict[str, dict[str, list[float]]] = {w: {"direct": [], "bpf": []} for w in amounts}
    cpu: dict[str, dict[str, list[float]]] = {w: {"direct": [], "bpf": []} for w in amounts}
    with _setup() as (_topo, cg, cli):
        for _ in range(rounds):
            for what, amount in amounts.items():
                for name, group, host in (("direct", None, POD), ("bpf", cg, VIP)):
                    r = _run(group, cli, what, host, amount)
                    rates[what][name].append(r["rate"])
                    cpu[what][name].append(r["client_cpu"] / (r["rate"] * r["wall"]))
    report: dict[str, Any] = {"rounds": rounds, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "cpus": os.cpu_count(), "results": {}}
    for what, by in rates.items():
        d, b = statistics.median(by["direct"]), statistics.median(by["bpf"])
        cd, cb = statistics.median(cpu[what]["direct"]), statistics.median(cpu[what]["bpf"])
        report["results"][what] = {"direct": d, "bpf": b, "ratio": b / d,
                                   "unit": "MB/s" if what == "bulk" else "per s",
                                   "ratios_per_round": [x / y for x, y in zip(by["bpf"], by["direct"])],
                                   "client_cpu_per_unit": {"direct": cd, "bpf": cb, "ratio": cb / cd}}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--conns", type=int, default=2000)
    p.add_argument("--rr", type=int, default=20000)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = measure(args.rounds, args.mib, args.conns, args.rr)
    for what, r in report["results"].items():
        print(f"{what:5} direct={r['direct']:10.1f} bpf={r['bpf']:10.1f} {r['unit']:5} ratio={r['ratio']:.3f} "
              f"client-cpu ratio={r['client_cpu_per_unit']['ratio']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
