"""The live page of an `--offload bpf` agent says why a ServicePort on BPF still has relayed flows:
a client outside the test cgroup (this test's own process, in a client netns) connects to the
ClusterIP; the socket LB, attached to the test cgroup only, leaves its connect() alone, so the
relay's listener serves it, and the page, in headless Chromium, names the cgroup as the reason
while the flow is open and drops the note once it is closed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from tests.browser import Browser
from tests.netns import inside
from tests.offload.bpf.agent import Agent
from tests.offload.bpf.conftest import Env

pytestmark = pytest.mark.netns

VIP = "10.96.10.10"
WHY = ("document.querySelector('#services tr[data-spn=\"default/web:http\"] td.reason .why')"
       "?.textContent || ''")


def _manifests(path: Path) -> None:
    items = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
              "spec": {"clusterIP": VIP, "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                                    "protocol": "TCP"}]}},
             {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
              "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
              "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
              "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": True}}]}]
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))


def test_a_bpf_serviceport_with_relayed_flows_says_why(bpf_env: Env, tmp_path: Path) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    _manifests(tmp_path / "services.yaml")
    agent = Agent(bpf_env, tmp_path / "services.yaml", tmp_path / "agent.log")
    agent.start()
    browser = Browser(bpf_env.topo.node)
    try:
        assert "bpf" in agent.wait_bpf()["datapath"]
        browser.goto("http://127.0.0.1:10249/view")
        browser.wait("document.querySelectorAll('#services tbody tr').length === 1", timeout=10)
        assert browser.eval(WHY) == ""  # no relayed flow, nothing to explain
        with inside(cli):
            conn = socket.create_connection((VIP, 80), timeout=5)  # outside the test cgroup
        try:
            assert conn.recv(64).startswith(b"be-a")
            browser.wait("[...document.querySelectorAll('#flows tbody tr')].some(r => "
                         "r.textContent.startsWith('userspace'))", timeout=5, what="the relayed flow listed")
            browser.wait(f"({WHY}).startsWith('1 relayed flow: the BPF socket LB rewrites connect() only for "
                         "processes inside its cgroup (--bpf-cgroup)')", timeout=5, what="the reason given")
        finally:
            conn.close()
        browser.wait(f"{WHY} === ''", timeout=10, what="the note gone with the flow")
    finally:
        browser.close()
        agent.stop()
        agent.cleanup()
