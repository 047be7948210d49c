"""A real agent with `--offload bpf` in the node namespace of a BPF test's Env, run through
`nsenter --net` (not `ip netns exec`, which would hide the cgroup filesystem and bpffs it needs)
with the test cgroup as --bpf-cgroup and the Env's pins (USPROXY_BPF_PINS); its /services,
/flows and /metrics read from inside the namespace (test_agent, test_live_flows)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.netns import inside
from tests.offload.bpf.conftest import Env

USPROXY = str(Path(__file__).resolve().parents[3] / ".venv" / "bin" / "usproxy")


class Agent:
    offload_after = "0"  # seconds, as --offload-after

    def __init__(self, env: Env, manifests: Path, log: Path) -> None:
        self.env, self.manifests, self.log = env, manifests, log
        self.proc: subprocess.Popen[bytes] | None = None

    def _cmd(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.env.topo.node}", USPROXY, "-v", "run", *args]

    def _environ(self) -> dict[str, str]:
        return dict(os.environ, USPROXY_BPF_PINS=str(self.env.pin_root))

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self._cmd(
                "--services", str(self.manifests), "--offload", "bpf", "--offload-after", self.offload_after,
                "--bpf-cgroup", str(self.env.cgroup), "--healthz-bind-address", "127.0.0.1:10256",
                "--metrics-bind-address", "127.0.0.1:10249"), env=self._environ(), stdout=out, stderr=out)
        self.env.procs.append(self.proc)  # type: ignore[arg-type]

    def get(self, path: str) -> Any:
        with inside(self.env.topo.node), urllib.request.urlopen(f"http://127.0.0.1:10249{path}", timeout=5) as r:
            body = r.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def wait_bpf(self, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                rows = [r for r in self.get("/services") if r["servicePortName"] == "default/web:http"]
                if rows and "bpf" in rows[0]["datapath"]:
                    return dict(rows[0])
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"web never placed on bpf:\n{self.log.read_text()[-3000:]}")

    def relay_flows(self) -> float:
        text = self.get("/metrics")
        return sum(float(v) for v in re.findall(r'^usproxy_flows_total\{[^}]*\} (\S+)$', text, re.M))

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        assert self.proc.wait(15) == 0, self.log.read_text()[-3000:]

    def cleanup(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._cmd("--cleanup", "--bpf-cgroup", str(self.env.cgroup)), env=self._environ(),
                              capture_output=True, text=True, timeout=60)
