"""The run's parameters (/lab/params.json, written by the host), its working directory, and the
result a scenario fills in and writes to /lab/out/result.json, which the host reads.

Every scenario module (scenario.py, edge.py, arm64.py) takes these from here, so scenario.py can
import the others without them importing it back.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from node import OUT, say

PARAMS: dict[str, Any] = json.loads(Path("/lab/params.json").read_text())
WORK = Path("/lab/work")
# the socket LB serves this cgroup's processes only: under the scenario's cgroup v2 mount (init.sh)
CGROUP2_MOUNT = Path("/sys/fs/cgroup" if PARAMS.get("cgroups") == "v2" else "/sys/fs/cgroup/unified")
BPF_CGROUP = CGROUP2_MOUNT / "lab-node"


class Result:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "scenario": PARAMS["scenario"], "uname_r": platform.release(), "arch": platform.machine(),
            "memory_kib": meminfo("MemTotal"), "vcpus": os.cpu_count(), "missing": {}, "present": {},
            "check": [], "check_disagrees": [], "datapaths": {}, "expected": {}, "figures": {}, "failures": []}

    def fail(self, why: str) -> None:
        say(f"FAIL: {why}")
        self.data["failures"].append(why)

    def expect(self, ok: bool, why: str) -> bool:
        if not ok:
            self.fail(why)
        return ok

    def write(self) -> None:
        self.data["passed"] = not self.data["failures"]
        (OUT / "result.json").write_text(json.dumps(self.data, indent=1, default=str))


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0
