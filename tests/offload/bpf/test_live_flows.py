"""Live flows across the `--offload bpf` promotion: connections and connected UDP sessions the
relay took before the ServicePort moved to the socket LB keep running on the relay, because the
socket LB translates only at connect() (and at an unconnected send), never an existing socket's
traffic. New connections after the promotion bypass the relay.

The agent runs through `nsenter --net` with the test cgroup and throwaway pins (test_agent.py's
Agent); clients run in the test cgroup, so they are the ones the socket LB serves.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.offload.bpf.agent import Agent
from tests.offload.bpf.conftest import Env

pytestmark = pytest.mark.netns

VIP, UDP_VIP = "10.96.10.10", "10.96.10.20"


def _manifests(path: Path) -> None:
    items: list[dict[str, Any]] = []
    for name, vip, port, proto, pname in (("web", VIP, 80, "TCP", "http"), ("dns", UDP_VIP, 53, "UDP", "dns")):
        items.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
                      "spec": {"clusterIP": vip, "ports": [{"name": pname, "port": port, "targetPort": 8080,
                                                            "protocol": proto}]}})
        items.append({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                      "metadata": {"name": f"{name}-1", "namespace": "default",
                                   "labels": {"kubernetes.io/service-name": name}},
                      "ports": [{"name": pname, "port": 8080, "protocol": proto}],
                      "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}
                                    for ip in ("10.244.1.5", "10.244.2.5")]})
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))


def _relayed(agent: Agent) -> bool:
    try:
        return {r["servicePortName"]: r["datapath"] for r in agent.get("/services")} == \
            {"default/web:http": "userspace", "default/dns:dns": "userspace"}
    except OSError:
        return False


def _ticked(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "tick", proc.stderr


def _summary(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(input="", timeout=10)
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_bpf_promotion_leaves_relayed_flows_alone(bpf_env: Env, tmp_path: Path) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    _manifests(tmp_path / "services.yaml")
    agent = Agent(bpf_env, tmp_path / "services.yaml", tmp_path / "agent.log")
    agent.offload_after = "3"
    agent.start()
    deadline = time.monotonic() + 10
    while not _relayed(agent):
        assert time.monotonic() < deadline and agent.proc is not None and agent.proc.poll() is None, \
            agent.log.read_text()[-3000:]
        time.sleep(0.1)
    tcp = [bpf_env.start(cli, "hold", VIP, 80, "-", 0) for _ in range(4)]
    udp = [bpf_env.start(cli, "session", UDP_VIP, 53) for _ in range(3)]
    for p in (*tcp, *udp):
        _ticked(p)
    relayed = agent.relay_flows()
    assert relayed >= 7  # the relay took all of them
    assert agent.wait_bpf()["datapath"] == "bpf"
    listed = [f for f in agent.get("/flows") if f["datapath"] == "userspace"]
    assert len(listed) == 7, listed  # still the relay's, and listed as its flows
    assert bpf_env.run(cli, "tcp", VIP, 80, 10)["errors"] == {}
    assert agent.relay_flows() == relayed  # new connections bypass the relay
    time.sleep(1)
    for s in map(_summary, tcp):
        assert s["fails"] == 0 and s["tcp_ok"] >= 40, s  # ~20 round trips a second, none lost
    for s in map(_summary, udp):
        assert s["fails"] == 0 and len(s["names"]) == 1, s  # the relay kept the session's endpoint
    agent.stop()
    assert agent.cleanup().returncode == 0
