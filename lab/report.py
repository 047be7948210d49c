"""`python3 -m lab.report DIR...`: the docs' tables from kept results (`vm.sh --results DIR`):
one markdown row per run, from its summary.json and the guest's result.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CAPS = ("nftables", "bpf cgroup hooks", "bpf tc (tcx) attach", "conntrack", "ipvs")


def placed(datapath: str) -> str:
    """"bpf" alone serves only the node's own processes (the socket LB): forwarded traffic is the relay's."""
    parts = datapath.split("+")
    return f"{datapath} (forwarded: relay)" if parts == ["bpf"] else datapath


def row(directory: Path) -> str:
    s: dict[str, Any] = json.loads((directory / "summary.json").read_text())
    r: dict[str, Any] = json.loads((directory / "guest" / "result.json").read_text())
    missing = ", ".join(k for k, v in s.get("missing", {}).items() if v) or "-"
    check = " ".join(f"{c.split()[0] if c != 'bpf tc (tcx) attach' else 'tcx'}:{'y' if s['check'].get(c) else 'n'}"
                     for c in CAPS if c in s.get("check", {}))
    paths = sorted({placed(str(d)) for d in s.get("datapaths", {}).values()}) if s["scenario"] != "edge-256" else \
        [f"{k} ({v})" for k, v in s.get("datapaths", {}).items()]
    fig = s.get("figures", {})
    verdict = "passed" if s.get("passed") else "FAILED"
    if s.get("pending"):
        verdict += f" ({s['pending']})"
    return (f"| {s['scenario']} | {r['arch']}, {s.get('vcpus')} vCPU, {s.get('memory_kib', 0) // 1024} MiB | {missing} | "
            f"{check} | {', '.join(map(str, paths))} | {fig.get('agent_rss_kib', fig.get('rss_idle_kib', 0)) // 1024} MiB | "
            f"{s['times']['boot_to_poweroff_s']:.0f} s | {verdict} |")


def main(argv: list[str]) -> int:
    print("| machine | arch, vCPU, memory | missing (proven in the guest) | usproxy check | datapath | agent RSS | boot to poweroff | result |")
    print("|---|---|---|---|---|---|---|---|")
    for d in argv:
        print(row(Path(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
