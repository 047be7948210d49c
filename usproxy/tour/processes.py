"""The processes of a tour: the endpoints, the client and the agent, each in its namespace.

Each is started through `nsenter --net` (mounts kept: the agent needs cgroup2 and bpffs), in a
session of its own, so a Ctrl-C at the terminal reaches only the tour, which then stops them in
order. The client joins the tour's cgroup before it starts (cgroup.procs, written in the child
between fork and exec), so the BPF socket load balancer sees its connections.

`Agent` is `usproxy run` as a user runs it, with the flags below, and is read as a user reads
it: /metrics (usproxy_service_ports, usproxy_kernel_writes_total, kubeproxy_* sync metrics) and
/services on its metrics address inside the node namespace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from usproxy.tour.manifests import NODE
from usproxy.util.netns import inside

METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"
NODEPORT_ADDRESSES = "192.0.2.10/32"  # held by no interface: no NodePort frontends, no tc programs
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def spawn(ns: str, argv: list[str], *, cgroup: Path | None = None, log: IO[bytes] | None = None,
          env: dict[str, str] | None = None, pipes: bool = False) -> subprocess.Popen[bytes]:
    """`argv` in network namespace `ns` (and cgroup `cgroup`), in a session of its own."""
    def enter_cgroup() -> None:
        if cgroup is not None:
            with open(cgroup / "cgroup.procs", "w") as f:
                f.write("0")  # the writer itself

    return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "--", *argv],
                            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                            stdout=subprocess.PIPE if pipes else (log or subprocess.DEVNULL),
                            stderr=log or subprocess.DEVNULL, env=env, start_new_session=True,
                            preexec_fn=enter_cgroup)


def stop(p: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; pipes closed."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for f in (p.stdin, p.stdout):
        if f is not None:
            f.close()


class _LineProcess:
    """A child that takes one line on stdin and answers with JSON lines on stdout."""

    proc: subprocess.Popen[bytes]
    what: str

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.what}: no answer within {timeout:.0f} s")
        line = self.proc.stdout.readline().decode()
        if not line:
            raise RuntimeError(f"{self.what} exited (code {self.proc.poll()})")
        return line

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        stop(self.proc, 5.0)


class Endpoints(_LineProcess):
    """The endpoint servers (usproxy/tour/endpoints.py) in the pods' namespace."""

    def __init__(self, ns: str, specs: list[str]) -> None:
        self.what = "the endpoints"
        self.proc = spawn(ns, [sys.executable, "-m", "usproxy.tour.endpoints", *specs], pipes=True)
        if self._line(30).strip() != "ready":
            raise RuntimeError("the endpoints did not start")

    def counts(self) -> dict[str, int]:
        """Connections each endpoint accepted so far, by "address:port"."""
        self._send("counts")
        return {k: int(v) for k, v in json.loads(self._line(30)).items()}


class Client(_LineProcess):
    """The tour's client (usproxy/tour/client.py) in the node's namespace and the tour's cgroup."""

    def __init__(self, ns: str, cgroup: Path) -> None:
        self.what = "the client"
        self.proc = spawn(ns, [sys.executable, "-m", "usproxy.tour.client"], cgroup=cgroup, pipes=True)

    def ask(self, spec: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        self._send(json.dumps(spec))
        answer: dict[str, Any] = json.loads(self._line(timeout))
        return answer

    def until(self, spec: dict[str, Any], change: Callable[[], float]) -> tuple[float, dict[str, Any]]:
        """Start polling, call `change` (it returns when it changed something) once polling
        answers, and return (change's time, the client's answer)."""
        self._send(json.dumps({"op": "until", **spec}))
        first: dict[str, Any] = json.loads(self._line(float(spec["timeout"]) + 30))
        if not first.get("polling"):
            raise RuntimeError(f"the client could not reach {spec['ip']}:{spec['port']} before the change: {first}")
        t = change()
        answer: dict[str, Any] = json.loads(self._line(float(spec["timeout"]) + 30))
        return t, answer


class Agent:
    """`usproxy run` for one mode in the node's namespace."""

    def __init__(self, ns: str, offload: str, manifest: Path, cgroup: Path, pin_root: Path, log: Path) -> None:
        self.ns, self.offload = ns, offload
        self.argv = ["usproxy", "run", "--services", str(manifest), "--offload", offload,
                     "--offload-after", "0", "--lb-policy", "random", "--sync-period", "1h",
                     "--hostname-override", NODE, "--nodeport-addresses", NODEPORT_ADDRESSES,
                     "--metrics-bind-address", METRICS, "--healthz-bind-address", HEALTHZ,
                     "--bpf-cgroup", str(cgroup)]
        self._log = log.open("ab")
        env = {**os.environ, "USPROXY_BPF_PINS": str(pin_root)}
        self.proc = spawn(ns, [sys.executable, "-m", "usproxy", *self.argv[1:]], log=self._log, env=env)

    def get(self, path: str, timeout: float = 30.0) -> bytes:
        if self.proc.poll() is not None:
            raise RuntimeError(f"usproxy run --offload {self.offload} exited (code {self.proc.returncode}); "
                               f"its log: {self._log.name}")
        with inside(self.ns):
            with urllib.request.urlopen(f"http://{METRICS}{path}", timeout=timeout) as resp:
                body: bytes = resp.read()
        return body

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        out = {}
        for line in self.get("/metrics").decode().splitlines():
            m = _SAMPLE.match(line)
            if m:
                labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
                out[(m.group(1), labels)] = float(m.group(3))
        return out

    def placed(self) -> dict[str, int]:
        """ServicePorts per serving datapath (usproxy_service_ports)."""
        return {dict(labels)["datapath"]: int(v) for (name, labels), v in self.metrics().items()
                if name == "usproxy_service_ports"}

    def services(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = json.loads(self.get("/services"))
        return rows

    def wait_placed(self, datapath: str, n: int, timeout: float) -> float:
        """Wait until `n` ServicePorts are served by `datapath`; the seconds it took."""
        t0 = time.monotonic()
        last: dict[str, int] = {}
        while time.monotonic() - t0 < timeout:
            try:
                last = self.placed()
            except OSError:  # not listening yet
                last = {}
            if last.get(datapath) == n and sum(last.values()) == n:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"usproxy run --offload {self.offload}: {n} ServicePorts on {datapath} not reached in "
                           f"{timeout:.0f} s (placed: {last}); its log: {self._log.name}")

    def close(self) -> None:
        stop(self.proc, 20.0)
        self._log.close()
