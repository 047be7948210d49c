"""A static-manifest, relay-only agent (`usproxy run --services DIR --offload none`) loads no
module it never uses: not the Kubernetes API client, not the BPF datapath (its registry
declaration is read: a few lines) or the offload manager, not `usproxy explain` (the web view loads it on its first /view/service request). pyroute2 is
used (the ClusterIP interface is managed through it), and so is the nftables datapath, once at
start: it looks for an earlier run's tables to remove them (app/cleanup.remove_leftovers, as
kube-proxy's platformCleanup). Each costs RSS on small nodes (issue 17); the modes that use them
import them when used, which their own tests exercise.

The agent runs in a subprocess in a throwaway network namespace; a thread in that process waits
for the first completed sync, writes `sys.modules` to a file and stops the agent with SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.netns import Topology

ROOT = Path(__file__).resolve().parents[2]

# Runs the agent's own entry point; a daemon thread reports sys.modules once /healthz says synced.
RUNNER = """
import json, os, signal, sys, threading, time, urllib.request
out = sys.argv[1]
def report():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:10256/healthz", timeout=2) as r:
                if not json.load(r)["lastUpdated"].startswith("0001-"):
                    break
        except OSError:
            pass
        time.sleep(0.05)
    with open(out, "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=report, daemon=True).start()
sys.argv = ["usproxy", *sys.argv[2:]]
from usproxy.app.cli import main
sys.exit(main())
"""

NEVER = ("kubernetes_asyncio", "usproxy.sources.kube", "usproxy.sources.reflector",
         "usproxy.sources.api_list_watch", "usproxy.offload.manager",
         "usproxy.offload.bpf.datapath", "usproxy.offload.bpf.libbpf",
         "usproxy.offload.bpf.loader", "usproxy.explain")


def _manifest(directory: Path) -> None:
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
             {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}]
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
           "spec": {"clusterIP": "10.96.0.10", "ports": ports}}
    sl = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
          "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
          "ports": [{"name": p["name"], "port": p["targetPort"], "protocol": p["protocol"]} for p in ports],
          "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": True}}]}
    (directory / "services.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [svc, sl]}))


@pytest.mark.netns
def test_a_static_relay_only_agent_imports_none_of_what_it_never_uses(topology: Topology, tmp_path: Path) -> None:
    _manifest(tmp_path)
    report = tmp_path / "modules.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), USPROXY_EVENT_LOOP="uvloop")
    run = subprocess.run(
        ["ip", "netns", "exec", topology.node, sys.executable, "-c", RUNNER, str(report),
         "run", "--services", str(tmp_path), "--offload", "none", "--vip-interface", "usptest0",
         "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert report.exists(), run.stdout + run.stderr
    modules = set(report.read_text().split())
    assert {"usproxy.relay.relay", "usproxy.sources.static", "aiohttp.web"} <= modules  # it ran as meant
    loaded = sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NEVER))
    assert loaded == [], run.stderr[-2000:]
