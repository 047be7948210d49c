"""Harness for relay tests in network namespaces: manifests, backends, the agent under test.

`svc()` and `slice_()` write Kubernetes objects as kubectl prints them; `Manifests.write()` replaces
the file atomically (rename), as an operator's tool would. `AgentProc` runs the real
`usproxy run` in the node netns (event loop chosen by USPROXY_EVENT_LOOP) and reads its /services
and /flows from inside that netns. Backends run as subprocesses in pod netns. Everything started
here is stopped by `close()`, which the fixtures call whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.netns import Topology, inside

ROOT = Path(__file__).resolve().parents[2]
# the worktree's venv; where there is none (the VM lab's guest, which installs the wheel), the
# usproxy next to this interpreter
USPROXY = str(next((p for p in (ROOT / ".venv" / "bin" / "usproxy", Path(sys.executable).with_name("usproxy"))
                    if p.exists()), ROOT / ".venv" / "bin" / "usproxy"))
BACKENDS = str(Path(__file__).with_name("backends.py"))


def svc(name: str, cluster_ip: str, ports: list[dict[str, Any]], namespace: str = "default",
        **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"clusterIP": cluster_ip, "ports": ports}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def slice_(service: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]],
           namespace: str = "default", name: str | None = None, address_type: str = "IPv4") -> dict[str, Any]:
    """endpoints: [{"ip": ..., "ready": bool, "serving": ..., "terminating": ..., "nodeName": ...}]"""
    eps = []
    for e in endpoints:
        cond = {k: e[k] for k in ("ready", "serving", "terminating") if k in e}
        item: dict[str, Any] = {"addresses": [e["ip"]], "conditions": cond}
        if "nodeName" in e:
            item["nodeName"] = e["nodeName"]
        eps.append(item)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
            "metadata": {"name": name or f"{service}-abc", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service}},
            "ports": ports, "endpoints": eps}


class Manifests:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "services.yaml"

    def write(self, *objects: dict[str, Any]) -> float:
        """Atomically replace the manifest; returns T_upd, time.monotonic() just before the rename
        (inotify wakes the agent at once: it may have synced before this process runs again)."""
        tmp = self.dir / ".services.yaml.tmp"
        tmp.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": list(objects)}))
        t_upd = time.monotonic()
        os.rename(tmp, self.path)
        return t_upd


class AgentProc:
    """`usproxy run` in the node netns."""

    wrapper: tuple[str, ...] = ()  # a command that execs the agent, e.g. ("prlimit", "--nofile=1024:1024")

    def __init__(self, topo: Topology, manifests: Manifests, loop: str = "uvloop", *extra: str) -> None:
        self.topo = topo
        self.manifests = manifests
        self.loop = loop
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = manifests.dir / "agent.log"

    def start(self, timeout: float = 10.0) -> None:
        env = dict(os.environ, USPROXY_EVENT_LOOP=self.loop)
        cmd = ["ip", "netns", "exec", self.topo.node, *self.wrapper, USPROXY, "-v", "run", "--services", str(self.manifests.dir),
               "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249",
               "--offload", "none", *self.extra]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if not self.get("/healthz", port=10256)["lastUpdated"].startswith("0001-"):
                    return  # the first sync has completed
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"agent did not come up:\n{self.log.read_text()}")

    def wait_synced_after(self, t_upd: float, timeout: float = 5.0) -> float:
        """Wait until a sync completed after monotonic time `t_upd`; returns when (monotonic)."""
        deadline = time.monotonic() + timeout
        start_wall = time.time() - (time.monotonic() - t_upd)
        while time.monotonic() < deadline:
            body = self.get("/healthz", port=10256)
            last = body["lastUpdated"]
            if not last.startswith("0001-"):
                stamp = time.mktime(time.strptime(last[:19], "%Y-%m-%d %H:%M:%S")) - time.timezone
                if stamp + float("0." + last[20:26]) > start_wall:
                    return time.monotonic()
            time.sleep(0.05)
        raise TimeoutError("no sync after the update")

    def get(self, path: str, port: int = 10249) -> Any:
        with inside(self.topo.node):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return json.load(r)

    def services(self) -> list[dict[str, Any]]:
        return list(self.get("/services"))

    def flows(self) -> list[dict[str, Any]]:
        return list(self.get("/flows"))

    def pid(self) -> int:
        """The agent's own pid (the child of `ip netns exec`, which execs it)."""
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc


class Backends:
    """Backend processes in pod netns, all stopped by `close()`."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, ns: str, *args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, BACKENDS, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout is not None
        p.stdout.readline()  # "ready"
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        _end(p)
        self.procs.remove(p)

    def close(self) -> None:
        for p in self.procs:
            _end(p)
        self.procs.clear()


def _end(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def vm_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(key)
