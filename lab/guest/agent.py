"""The agent under test, in the guest's root namespace (the node): started from the wheel installed
at boot, read through its own admin endpoints (/services, /flows, /healthz) and `usproxy status
--json`, stopped with SIGTERM. Its log goes to /lab/out/agent-<label>.log.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from node import OUT, cpu_s, rss_kib, say, sh

METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"


class Agent:
    def __init__(self, services: Path, *flags: str, label: str = "agent") -> None:
        self.log = OUT / f"{label}.log"
        cmd = ["usproxy", "run", "--services", str(services), "--metrics-bind-address", METRICS,
               "--healthz-bind-address", HEALTHZ, *flags]
        say(f"starting: {' '.join(cmd)}")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        self.start_s = self._wait_listed()

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://{METRICS}{path}", timeout=30) as resp:
            return json.loads(resp.read())

    def _wait_listed(self) -> float:
        """Seconds until /services lists ServicePorts (the agent has read its manifests)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode} ({memory_state()}): {self.log.read_text()[-1500:]}")
            try:
                if self.get("/services"):
                    return round(time.monotonic() - self.started, 1)
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"agent did not list its Services in 300 s ({memory_state()}); "
                           f"log tail: {self.log.read_text()[-800:]}")

    def datapaths(self) -> dict[str, str]:
        return {row["servicePortName"]: row["datapath"] for row in self.get("/services")}

    def reasons(self) -> dict[str, str]:
        return {row["servicePortName"]: row["reason"] for row in self.get("/services")}

    def wait_datapaths(self, want: dict[str, str], timeout: float) -> dict[str, str]:
        """Poll until every ServicePort in `want` is on its datapath ("a+b" in any order), or timeout."""
        deadline = time.monotonic() + timeout
        now: dict[str, str] = {}
        while time.monotonic() < deadline:
            now = self.datapaths()
            if all(set(now.get(spn, "").split("+")) == set(d.split("+")) for spn, d in want.items()):
                break
            time.sleep(1)
        return now

    def status_json(self) -> Any:
        out = sh("usproxy", "status", "--json", "--metrics-bind-address", METRICS, check=False)
        try:
            return json.loads(out.stdout)
        except ValueError:
            return {"error": out.stderr.strip()[-300:]}

    def relay_flows(self) -> int:
        """Flows the relay itself has carried so far (the flow table's own entries)."""
        return sum(1 for f in self.get("/flows") if f.get("datapath") in ("userspace", "relay", None))

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def memory_state() -> str:
    """The node's memory in one line, for a failure's message: what is left, how much time tasks
    lose waiting for memory (PSI), whether the OOM killer ran."""
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    words = [f"MemAvailable {info.get('MemAvailable', 0) // 1024} MiB of {info.get('MemTotal', 0) // 1024} MiB"]
    try:
        some = Path("/proc/pressure/memory").read_text().split("\n")[0]
        words.append("memory pressure " + some.split()[1].replace("=", " ") + "%")
    except OSError:
        pass
    # /proc/vmstat's counter, not dmesg: a thrashing machine may not fork a reader in minutes
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    words.append(f"OOM kills so far: {vmstat.get('oom_kill', '?')}")
    return ", ".join(words)


def cleanup() -> None:
    """`usproxy run --cleanup`: the kernel state one agent left, before the next starts."""
    sh("usproxy", "run", "--cleanup", check=False)
