"""Stale UDP conntrack cleanup at scale (issue 29 item 8): how long it takes, what CPU it costs,
and what it does to the relay meanwhile.

`sudo .venv/bin/python -m bench.conntrack_cleanup [--entries 150000] [--rounds 3]
[--pyroute2-entries 15000] [--no-relay] [--stem NAME]`

Part 1, per method and round (rounds interleaved, each in a throwaway netns `benchct<hex>`):
ENTRIES UDP entries DNATed to one endpoint are made through ctnetlink
(tests/offload/conntrack_fill.py) and deleted by
- `usproxy-filtered`: usproxy's cleanup child (usproxy/offload/ctnetlink.py) with the rule of a
  pass for that Service: one dump the kernel filters for the frontend, batched deletes;
- `usproxy-table`: the same child listing every UDP entry (the rule of removed endpoints, and of
  passes over more than 32 frontends);
- `conntrack-tool`: `conntrack -D -p udp --reply-src EP --reply-port-src 53` (conntrack-tools:
  a filtered dump, then one delete request per entry);
- `pyroute2`: the code before (pyroute2's Conntrack: a kernel-filtered dump decoded into Python
  objects, one delete per request, in the calling process), on `--pyroute2-entries` entries
  (150,000 take minutes) and scaled to ENTRIES.
Wall time, and CPU (user+system) of the process doing the work (children: RUSAGE_CHILDREN).

Part 2 (`--no-relay` skips it): a real agent (`--offload nftables`) with an offloaded UDP
Service (two endpoints) and a UDP echo Service pinned to the relay; a client asks the relay's
echo 500 times a second. ENTRIES entries are made for the offloaded Service's first endpoint,
which is then removed from the manifest: the echo's round trips before and during the cleanup
(until the table is back under 1,000 entries) are compared.

Writes bench/results/<stem>.json and .md and prints the markdown. Figures are reported, never
asserted (tests assert behaviour only).
"""

from __future__ import annotations

import argparse
import json
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

from tests.netns import Topology, inside, nsexec, sh
from tests.offload.conntrack_fill import fill_udp
from tests.offload.harness import OFFLOAD, Pods, udp_socket
from tests.relay.harness import AgentProc, Manifests, slice_, svc
from usproxy.offload.kernel_conntrack import KernelConntrack
from usproxy.core.stale_udp import StaleUdp, packed

RESULTS = Path(__file__).parent / "results"
FRONTEND, ENDPOINT, OTHER = ("10.96.0.10", 53), ("10.244.1.5", 53), ("10.244.1.6", 53)
METHODS = ("usproxy-filtered", "usproxy-table", "conntrack-tool", "pyroute2")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def count(ns: str) -> int:
    return int(nsexec(ns, "conntrack", "-C").stdout.strip())


def run_method(method: str, ns: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one method deleting what fill_udp made in `ns`."""
    t0, c0, s0 = time.monotonic(), children_cpu(), self_cpu()
    if method.startswith("usproxy"):
        front, other = (packed(FRONTEND[0]), FRONTEND[1]), (packed(OTHER[0]), OTHER[1])
        rule = (StaleUdp.replying_from([ENDPOINT]) if method == "usproxy-table"
                else StaleUdp({front: frozenset({other})}, {}, frozenset({front[0]})))
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "usproxy.offload.ctnetlink"],
                       input=rule.to_json(), text=True, capture_output=True, check=True)
    elif method == "conntrack-tool":
        subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-D", "-p", "udp", "--reply-src", ENDPOINT[0],
                        "--reply-port-src", str(ENDPOINT[1])], capture_output=True, check=False)
    else:
        kc = KernelConntrack(ns)
        try:
            kc._worker.call(kc._delete_udp, {ENDPOINT}, set())
        finally:
            kc.close()
    wall = time.monotonic() - t0
    cpu = (children_cpu() - c0) + (self_cpu() - s0 if method == "pyroute2" else 0.0)
    return wall, cpu


def part1(entries: int, rounds: int, pyroute2_entries: int) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for method in order:
            ns = f"benchct{secrets.token_hex(3)}"
            sh("ip", "netns", "add", ns)
            try:
                n = pyroute2_entries if method == "pyroute2" else entries
                with inside(ns):
                    made = fill_udp(n, FRONTEND, ENDPOINT)
                wall, cpu = run_method(method, ns)
                left = count(ns)
                scale = entries / n
                out[method].append({"entries": made, "left": left, "wall": wall * scale, "cpu": cpu * scale,
                                    "measured_wall": wall, "measured_cpu": cpu})
                print(f"round {r + 1} {method}: {made} entries, {wall:.2f} s wall, {cpu:.2f} s CPU, {left} left",
                      flush=True)
            finally:
                sh("ip", "netns", "del", ns, check=False)
    return out


def echo_rtts(sock: socket.socket, until: threading.Event, out: list[float], rate: float = 500.0) -> None:
    """One query per 1/rate s on `sock` (an echo), round trips in ms into `out` (a loss: 1000)."""
    seq = 0
    while not until.is_set():
        seq += 1
        t0 = time.monotonic()
        sock.send(b"%d" % seq)
        try:
            while True:
                data = sock.recv(64)
                if data.split(b"|")[-1] == b"%d" % seq:
                    break
            out.append((time.monotonic() - t0) * 1000)
        except socket.timeout:
            out.append(1000.0)
        time.sleep(max(0.0, 1 / rate - (time.monotonic() - t0)))


def summary(rtts: list[float]) -> dict[str, float]:
    if not rtts:
        return {}
    q = statistics.quantiles(rtts, n=100)
    return {"n": len(rtts), "p50": round(q[49], 3), "p99": round(q[98], 3), "max": round(max(rtts), 3)}


def measure(sock: socket.socket, during: Any) -> list[float]:
    """Echo round trips (ms) while `during()` runs."""
    rtts: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=echo_rtts, args=(sock, stop, rtts))
    t.start()
    try:
        during()
    finally:
        stop.set()
        t.join()
    return rtts


def part2(entries: int, rounds: int, tmp: Path) -> dict[str, Any]:
    topo = Topology()
    pods = Pods(topo, tmp)
    agent: AgentProc | None = None
    try:
        topo.build_node()
        for name, ip in (("be-a", ENDPOINT[0]), ("be-b", OTHER[0]), ("be-e", "10.244.1.9")):
            pods.add(name, ip, port=53)
        cli = topo.add_host("cli", "10.244.9.10")
        m = Manifests(tmp / "m")
        ports = [{"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}]
        dns = svc("dns", FRONTEND[0], ports)
        echo = svc("echo", "10.96.0.20", ports)
        echo["metadata"]["annotations"] = {"usproxy.io/datapath": "userspace"}

        def slices(*ips: str) -> list[dict[str, Any]]:
            return [slice_("dns", [{"ip": ip, "ready": True} for ip in ips], [{"name": "dns", "port": 53, "protocol": "UDP"}]),
                    slice_("echo", [{"ip": "10.244.1.9", "ready": True}], [{"name": "dns", "port": 53, "protocol": "UDP"}])]

        m.write(dns, echo, *slices(ENDPOINT[0], OTHER[0]))
        agent = AgentProc(topo, m, "uvloop", *OFFLOAD)
        agent.start()
        time.sleep(3)  # offloaded after 1 s
        sock = udp_socket(cli, ("10.244.9.10", 42000))
        sock.connect(("10.96.0.20", 53))
        sock.settimeout(1.0)
        out: dict[str, Any] = {"rounds": []}
        for i in range(rounds):
            if i:  # the removed endpoint back
                agent.wait_synced_after(m.write(dns, echo, *slices(ENDPOINT[0], OTHER[0])))
            with inside(topo.node):
                made = fill_udp(entries, FRONTEND, ENDPOINT)
            before = measure(sock, lambda: time.sleep(3))
            took: list[float] = []

            def cleanup() -> None:
                t0 = time.monotonic()
                m.write(dns, echo, *slices(OTHER[0]))
                while count(topo.node) > 1000 and time.monotonic() - t0 < 300:
                    time.sleep(0.2)
                took.append(time.monotonic() - t0)

            during = measure(sock, cleanup)
            out["rounds"].append({"entries": made, "cleanup_seconds": round(took[0], 2),
                                  "echo_before": summary(before), "echo_during": summary(during)})
        sock.close()
        return out
    finally:
        if agent is not None:
            agent.stop()
        pods.close()
        topo.close()


def markdown(p1: dict[str, list[dict[str, float]]], p2: dict[str, Any] | None, entries: int) -> str:
    lines = [f"## Stale UDP conntrack cleanup, {entries:,} entries", "",
             "| method | wall s (median) | CPU s (median) | rounds | left |", "|---|---:|---:|---:|---:|"]
    for m, rows in p1.items():
        if rows:
            lines.append(f"| {m} | {statistics.median(r['wall'] for r in rows):.2f} | "
                         f"{statistics.median(r['cpu'] for r in rows):.2f} | {len(rows)} | "
                         f"{max(r['left'] for r in rows):.0f} |")
    if p2:
        rows = p2["rounds"]

        def med(phase: str, key: str) -> float:
            return round(statistics.median(r[phase][key] for r in rows), 3)

        lines += ["", f"Relay UDP echo (500/s) while the agent cleared {rows[0]['entries']:,} entries "
                      f"({statistics.median(r['cleanup_seconds'] for r in rows):.1f} s), medians of {len(rows)} rounds: "
                      f"p50 {med('echo_before', 'p50')} → {med('echo_during', 'p50')} ms, "
                      f"p99 {med('echo_before', 'p99')} → {med('echo_during', 'p99')} ms, "
                      f"max {med('echo_before', 'max')} → {med('echo_during', 'max')} ms."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=150_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pyroute2-entries", type=int, default=15_000)
    ap.add_argument("--no-relay", action="store_true")
    ap.add_argument("--stem", default=f"{date.today().isoformat()}-conntrack")
    args = ap.parse_args()
    p1 = part1(args.entries, args.rounds, args.pyroute2_entries)
    tmp = Path(f"/tmp/benchct-{secrets.token_hex(3)}")
    tmp.mkdir()
    try:
        p2 = None if args.no_relay else part2(args.entries, args.rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.stem}.json").write_text(json.dumps({"methods": p1, "relay": p2, "loadavg": load}, indent=1))
    text = markdown(p1, p2, args.entries) + f"\nLoad average at the end: {' '.join(load)}.\n"
    (RESULTS / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
