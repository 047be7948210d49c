"""The real agent with `--offload bpf`: the socket LB serves local clients, the relay sees nothing,
an agent restart leaves connections alone, and `usproxy run --cleanup` removes everything.

The agent runs in netns node through `nsenter --net` (not `ip netns exec`, which would hide the
cgroup filesystem and bpffs it needs), with the test cgroup as --bpf-cgroup and throwaway pins
(USPROXY_BPF_PINS).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns import inside
from tests.offload.bpf.agent import USPROXY, Agent
from tests.offload.bpf.conftest import Env, attached_programs
from usproxy.offload.bpf import loader

pytestmark = pytest.mark.netns


def _manifests(path: Path) -> None:
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
           "spec": {"clusterIP": "10.96.10.10", "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                                           "protocol": "TCP"}]}}
    eps = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
           "metadata": {"name": "web-1", "namespace": "default",
                        "labels": {"kubernetes.io/service-name": "web"}},
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
           "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ("10.244.1.5", "10.244.2.5")]}
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [svc, eps]}))


def test_agent_offloads_to_bpf_and_survives_restart(bpf_env: Env, tmp_path: Path) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    _manifests(tmp_path / "services.yaml")
    agent = Agent(bpf_env, tmp_path / "services.yaml", tmp_path / "agent.log")
    agent.start()
    row = agent.wait_bpf()
    relayed = agent.relay_flows()

    out = bpf_env.run(cli, "tcp", "10.96.10.10", 80, 100)
    assert out["errors"] == {} and set(out["names"]) == {"be-a", "be-b"}
    assert agent.relay_flows() == relayed  # the relay saw none of them
    # a process outside the cgroup is not covered: the relay serves it (so the counter counts)
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 3, in_cgroup=False)["errors"] == {}
    assert agent.relay_flows() == relayed + 3
    hold = bpf_env.start(cli, "hold", "10.96.10.10", 80, "-", 0)
    assert hold.stdout is not None and hold.stdout.readline().strip() == "tick"
    assert any(f["datapath"] == "bpf" for f in agent.get("/flows")), row

    agent.stop()  # SIGTERM: the kernel state stays
    assert set(attached_programs(bpf_env.cgroup)) == set(loader.PROGRAMS)
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["errors"] == {}
    agent.start()
    agent.wait_bpf()
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["errors"] == {}
    agent.stop()

    out_text, _ = hold.communicate(input="", timeout=10)
    summary = json.loads(out_text.strip().splitlines()[-1])
    assert summary["tcp_ok"] > 0, summary  # the long-lived connection lived through both restarts
    assert agent.cleanup().returncode == 0
    assert attached_programs(bpf_env.cgroup) == {}
    assert not bpf_env.pin_root.exists()


class RelayAgent(Agent):
    """An agent without BPF (`--offload none`) in netns `ns`, with the same pin root."""

    offload = "none"

    def __init__(self, env: Env, manifests: Path, log: Path, ns: str) -> None:
        super().__init__(env, manifests, log)
        self.ns = ns

    def _cmd(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}", USPROXY, "-v", "run", *args]

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self._cmd(
                "--services", str(self.manifests), "--offload", self.offload, "--offload-after", self.offload_after,
                "--bpf-cgroup", str(self.env.cgroup),
                "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"),
                env=self._environ(), stdout=out, stderr=out)
        self.env.procs.append(self.proc)  # type: ignore[arg-type]

    def wait_relay(self, timeout: float = 20) -> None:
        """Until the relay listens for web (its /services reason says so)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if any(r["servicePortName"] == "default/web:http" and "listening on" in r["reason"]
                       for r in self.get("/services")):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"web never relayed:\n{self.log.read_text()[-3000:]}")

    def wait_log(self, text: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            if text in (log := self.log.read_text()):
                return log
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never logged:\n{self.log.read_text()[-3000:]}")


def test_an_agent_without_bpf_removes_an_earlier_runs_programs_and_pins(bpf_env: Env, tmp_path: Path) -> None:
    """As kube-proxy's platformCleanup: left in place, the socket LB would go on translating the
    ClusterIP to the earlier run's endpoints ahead of the relay."""
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    _manifests(tmp_path / "services.yaml")
    bpf_agent = Agent(bpf_env, tmp_path / "services.yaml", tmp_path / "bpf.log")
    bpf_agent.start()
    bpf_agent.wait_bpf()
    hold = bpf_env.start(cli, "hold", "10.96.10.10", 80, "-", 0)  # translated at connect(), long-lived
    assert hold.stdout is not None and hold.stdout.readline().strip() == "tick"
    bpf_agent.stop()  # SIGTERM: programs and pins stay, as for a restart
    assert set(attached_programs(bpf_env.cgroup)) == set(loader.PROGRAMS)

    relay = RelayAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "relay.log", bpf_env.topo.node)
    relay.start()
    log = relay.wait_log("removed BPF programs and pins under")
    assert str(bpf_env.pin_root) in log and "left by an earlier run with another --offload" in log
    assert attached_programs(bpf_env.cgroup) == {} and not bpf_env.pin_root.exists()
    relay.wait_relay()
    before = relay.relay_flows()
    out = bpf_env.run(cli, "tcp", "10.96.10.10", 80, 10)
    assert out["errors"] == {} and set(out["names"]) <= {"be-a", "be-b"}, out
    assert relay.relay_flows() == before + 10  # the relay carries them: no socket LB left
    time.sleep(1)
    out_text, _ = hold.communicate(input="", timeout=10)
    summary = json.loads(out_text.strip().splitlines()[-1])
    assert summary["fails"] == 0 and summary["tcp_ok"] > 20, summary  # connected to its pod: kept
    relay.stop()


def _bpf_agent_and_a_second_namespace(bpf_env: Env, tmp_path: Path) -> tuple[str, str, Agent]:
    """Two pods, a client namespace and another one, and a running `--offload bpf` agent that
    serves web on the socket LB."""
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    other = bpf_env.client_ns("other", "10.244.9.11")
    _manifests(tmp_path / "services.yaml")
    bpf_agent = Agent(bpf_env, tmp_path / "services.yaml", tmp_path / "bpf.log")
    bpf_agent.start()
    bpf_agent.wait_bpf()
    return cli, other, bpf_agent


def test_pins_a_running_bpf_agent_holds_are_kept(bpf_env: Env, tmp_path: Path) -> None:
    """The pin root is node-wide: an agent without BPF in another network namespace, with the same
    pin root, leaves a running BPF agent's programs and pins alone (its lock is held)."""
    cli, other, bpf_agent = _bpf_agent_and_a_second_namespace(bpf_env, tmp_path)
    relay = RelayAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "relay.log", other)
    relay.start()
    log = relay.wait_log("kept the BPF programs and pins under")
    assert f"uses the BPF pins under {bpf_env.pin_root}" in log, log
    assert set(attached_programs(bpf_env.cgroup)) == set(loader.PROGRAMS)
    relayed = bpf_agent.relay_flows()
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 10)["errors"] == {}
    assert bpf_agent.relay_flows() == relayed  # still the socket LB's
    relay.stop()
    bpf_agent.stop()
    assert bpf_agent.cleanup().returncode == 0


class AutoAgent(RelayAgent):
    """An agent with the default `--offload auto` in netns `ns`, with the same pin root."""

    offload = "auto"

    def get(self, path: str) -> Any:
        with inside(self.ns), urllib.request.urlopen(f"http://127.0.0.1:10249{path}", timeout=5) as r:
            body = r.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def wait_datapath(self, datapath: str, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                rows = [r for r in self.get("/services") if r["servicePortName"] == "default/web:http"]
                if rows and rows[0]["datapath"] == datapath:
                    return dict(rows[0])
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"web never placed on {datapath}:\n{self.log.read_text()[-3000:]}")


def test_an_auto_agent_leaves_bpf_to_the_agent_that_holds_its_pins(bpf_env: Env, tmp_path: Path) -> None:
    """The pin root is node-wide and one agent owns it: under `auto`, an agent that finds it held
    goes on down the ladder without BPF (nftables here) and says why, where `--offload bpf` would
    exit 1; the owner's socket LB keeps serving."""
    cli, other, bpf_agent = _bpf_agent_and_a_second_namespace(bpf_env, tmp_path)
    auto = AutoAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "auto.log", other)
    auto.start()
    log = auto.wait_log("bpf datapath left out")
    assert f"uses the BPF pins under {bpf_env.pin_root}" in log, log
    row = auto.wait_datapath("nftables")
    assert "bpf" not in row["datapath"], row
    assert set(attached_programs(bpf_env.cgroup)) == set(loader.PROGRAMS)
    relayed = bpf_agent.relay_flows()
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 10)["errors"] == {}
    assert bpf_agent.relay_flows() == relayed  # still the owner's socket LB
    auto.stop()
    bpf_agent.stop()
    assert bpf_agent.cleanup().returncode == 0


def test_an_auto_agent_restarted_adopts_its_bpf_pins(bpf_env: Env, tmp_path: Path) -> None:
    """`auto` uses the socket LB, so a restart with `auto` adopts its pins (C20) instead of
    removing them as leftovers of another mode; a connection translated before keeps talking."""
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    _manifests(tmp_path / "services.yaml")
    auto = AutoAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "auto.log", bpf_env.topo.node)
    auto.start()
    auto.wait_datapath("bpf+nftables")
    hold = bpf_env.start(cli, "hold", "10.96.10.10", 80, "-", 0)
    assert hold.stdout is not None and hold.stdout.readline().strip() == "tick"
    auto.stop()
    auto.start()
    auto.wait_datapath("bpf+nftables")
    log = auto.log.read_text()
    assert "removed BPF programs and pins" not in log and "maps read back from pins" in log, log[-3000:]
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["errors"] == {}
    auto.stop()
    out_text, _ = hold.communicate(input="", timeout=10)
    summary = json.loads(out_text.strip().splitlines()[-1])
    assert summary["fails"] == 0 and summary["tcp_ok"] > 0, summary
    assert auto.cleanup().returncode == 0
    assert attached_programs(bpf_env.cgroup) == {}
