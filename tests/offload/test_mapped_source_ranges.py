"""loadBalancerSourceRanges written IPv4-mapped (`::ffff:203.0.113.0/121`, issue 29 item 5), with
real traffic in every datapath that serves an LB IP: the relay (both event loops), nftables
offload and the tc programs of `--offload bpf`.

kube-proxy's IPFamilyOfCIDR reads such a range as 203.0.113.0/25, an IPv4 range: the IPv4 LB IP
is filtered by it. usproxy used to class it IPv6, so the IPv4 LB IP had no range of its family
and every outside client was served. Now a client inside the range reaches the pod through the LB
IP and one outside it gets no answer (DROP), in each datapath; the NodePort stays unfiltered.
The parsers are covered one by one in tests/model/test_ipv4_mapped.py."""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.lab import CGROUP2, BpfAgent
from tests.netns import Topology, nsexec
from tests.offload.harness import OFFLOAD, Pods, tcp_name, wait_listening
from tests.offload.agent import placement, wait_for
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

LB_IP, NODE_IP = "198.51.100.1", "192.0.2.10"
ALLOWED, BLOCKED = "203.0.113.2", "203.0.113.130"
MAPPED_RANGE = "::ffff:203.0.113.0/121"  # 203.0.113.0/25: ALLOWED inside, BLOCKED outside


def manifests() -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080}]
    web = svc("web", "10.96.10.10", ports, type="LoadBalancer", loadBalancerSourceRanges=[MAPPED_RANGE])
    web["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    eps = slice_("web", [{"ip": "10.244.1.5", "ready": True}], [{"name": "http", "port": 8080, "protocol": "TCP"}])
    return [web, eps]


def outcome(ns: str, addr: str, port: int, src: str) -> str:
    try:
        return tcp_name(ns, addr, port, timeout=1.5, src=src)
    except TimeoutError:
        return "timeout"
    except OSError as err:
        return err.strerror or "error"


@pytest.fixture
def client(topology: Topology, tmp_path: Path) -> Iterator[str]:
    pods = Pods(topology, tmp_path)
    try:
        pods.add("be-a", "10.244.1.5")
        cli = topology.add_host("ext", "10.244.9.30", ALLOWED, BLOCKED)
        nsexec(topology.node, "ip", "route", "add", "203.0.113.0/24", "via", "10.244.9.30")
        wait_listening(cli, "10.244.1.5", 8080)
        yield cli
    finally:
        pods.close()


def tc_agent(topology: Topology, m: Manifests, tmp_path: Path) -> BpfAgent:
    """`--offload bpf` on a throwaway cgroup and pin root: tc serves the LB IP on usbr0."""
    token = secrets.token_hex(4)
    cgroup = CGROUP2 / f"usproxy-test-{token}"
    cgroup.mkdir()
    config = tmp_path / "kp.yaml"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n")
    return BpfAgent(topology, m, config, cgroup, Path(f"/sys/fs/bpf/usproxy-test-{token}"))


def served_by_tc(agent: AgentProc) -> bool:
    try:
        rows = agent.services()
    except OSError:  # BpfAgent.start does not wait for the admin port
        return False
    return any(r["servicePortName"] == "default/web:http" and r.get("external") == "tc" for r in rows)


@pytest.mark.parametrize("datapath", ["relay-asyncio", "relay-uvloop", "nftables", "bpf-tc"])
def test_a_mapped_range_filters_the_ipv4_lb_ip(topology: Topology, tmp_path: Path, client: str, datapath: str) -> None:
    m = Manifests(tmp_path / "m")
    m.write(*manifests())
    if datapath.startswith("relay"):
        agent: AgentProc = AgentProc(topology, m, datapath.removeprefix("relay-"))
    elif datapath == "nftables":
        agent = AgentProc(topology, m, "uvloop", *OFFLOAD)
    else:
        agent = tc_agent(topology, m, tmp_path)
    try:
        agent.start()
        if datapath == "nftables":
            wait_for(lambda: placement(agent)[0] == "nftables", timeout=15, what="offload")
            firewall = nsexec(topology.node, "nft", "list", "map", "ip", "usproxy", "firewall-ips").stdout
            assert f"{LB_IP} . tcp . 80" in firewall, firewall
        if datapath == "bpf-tc":
            wait_for(lambda: served_by_tc(agent), timeout=15, what="tc serves the LB IP")
        assert outcome(client, LB_IP, 80, ALLOWED) == "be-a"
        assert outcome(client, LB_IP, 80, BLOCKED) == "timeout"  # was "be-a": no filter for IPv4
        assert outcome(client, NODE_IP, 30080, BLOCKED) == "be-a"  # NodePorts are not filtered
        if datapath == "bpf-tc":  # the allowed connection went through tc, not the relay behind it
            time.sleep(0.2)
            rows = [f for f in agent.flows() if f["original"]["src"].startswith(ALLOWED + ":")]
            assert any(f["datapath"] == "bpf-tc" for f in rows), rows
    finally:
        agent.stop()
        if isinstance(agent, BpfAgent):
            shutil.rmtree(agent.pins, ignore_errors=True)
            agent.cgroup.rmdir()
