"""detectLocalMode NodeCIDR without an API server and its building blocks: a Node's
spec.podCIDRs read as kube-proxy reads them (first CIDR per family, ParseCIDRSloppy), bad ones an
error naming the Node and the field, the detector built from them (a family without one gets the
no-op detector), the Node object of static manifests found (or a ConfigError naming
--detect-local-mode and what is missing), and a reload that changes them logged, not applied
(kube-proxy, cmd/kube-proxy/app/server_linux.go getLocalDetectors and waitForPodCIDR)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from usproxy.app.agent import node_facts
from usproxy.app.cli import build_parser, config_from_args
from usproxy.model.config import ProxyConfig
from usproxy.util.errors import ConfigError
from usproxy.model.manifest import objects_from
from usproxy.model.node import NodeFacts, detector_of, parse_node_pod_cidrs, resolve_node
from usproxy.sources.static import StaticSource, static_pod_cidrs
from usproxy.model.types import IPNetwork
from tests.sources.conftest import Recorder

NODE_CIDR = ProxyConfig(detect_local_mode="NodeCIDR", cluster_cidrs=("10.0.0.0/8",))


def nets(*texts: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(t) for t in texts)


def node(name: str = "node-a", pod_cidrs: Any = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "spec": {**({"podCIDRs": pod_cidrs} if pod_cidrs is not None else {}), **spec}}


def test_pod_cidrs_are_read_sloppily_and_in_order() -> None:
    got = parse_node_pod_cidrs(node(pod_cidrs=["010.244.001.000/24", "fd00:10:244:1::/64"]))
    assert got.name == "node-a" and not got.deleting
    assert got.pod_cidrs == nets("10.244.1.0/24", "fd00:10:244:1::/64")
    assert parse_node_pod_cidrs(node(podCIDR="10.244.2.0/24")).pod_cidrs == nets("10.244.2.0/24")  # old servers
    assert parse_node_pod_cidrs(node()).pod_cidrs == ()


@pytest.mark.parametrize("spec,field", [
    ({"podCIDRs": ["10.244.1.0/24", "10.244.1.0/33"]}, "spec.podCIDRs[1]"),
    ({"podCIDRs": ["10.244.1.7"]}, "spec.podCIDRs[0]"),  # an address is no CIDR
    ({"podCIDRs": "10.244.1.0/24"}, "spec.podCIDRs"),
    ({"podCIDR": "pods"}, "spec.podCIDR"),
])
def test_bad_pod_cidrs_name_the_node_and_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^Node node-a: {re.escape(field)}: "):
        parse_node_pod_cidrs(node(**spec))


def test_detector_is_the_first_pod_cidr_of_each_family_not_the_cluster_cidr() -> None:
    facts = resolve_node(NODE_CIDR, kubernetes=False, environ={"NODE_NAME": "node-a"},
                         pod_cidrs=nets("10.244.1.0/24", "10.244.9.0/24", "fd00:10:244:1::/64"))
    assert facts.pod_cidrs == nets("10.244.1.0/24", "10.244.9.0/24", "fd00:10:244:1::/64")
    assert facts.detector.mode == "NodeCIDR"
    assert facts.detector.if_not_local_nft(4) == "ip saddr != 10.244.1.0/24"
    assert facts.detector.if_local_nft(6) == "ip6 saddr fd00:10:244:1::/64"


def test_a_family_without_a_pod_cidr_gets_the_no_op_detector(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    det = detector_of(NODE_CIDR, nets("10.244.1.0/24"), node="node-a")
    assert det.implemented(4) and not det.implemented(6)
    assert "Node node-a has no IPv6 pod CIDR" in caplog.text
    assert detector_of(NODE_CIDR, (), node="node-a").mode is None  # none at all: kube-proxy's no-op detector


def test_node_cidr_needs_the_pod_cidrs_and_other_modes_ignore_them() -> None:
    with pytest.raises(ConfigError, match="detectLocalMode: NodeCIDR needs this Node's spec.podCIDRs"):
        resolve_node(NODE_CIDR, kubernetes=False, environ={})
    cluster = resolve_node(ProxyConfig(cluster_cidrs=("10.0.0.0/8",)), kubernetes=False, environ={},
                           pod_cidrs=nets("10.244.1.0/24"))
    assert cluster.pod_cidrs is None and cluster.detector.if_local_nft(4) == "ip saddr 10.0.0.0/8"


def test_the_flag_and_the_file_accept_node_cidr(tmp_path: Path) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                 "detectLocalMode: NodeCIDR\n")
    assert config_from_args(build_parser().parse_args(["run", "--config", str(f)])).detect_local_mode == "NodeCIDR"
    args = build_parser().parse_args(["run", "--detect-local-mode", "NodeCIDR", "--services", str(tmp_path)])
    assert config_from_args(args).detect_local_mode == "NodeCIDR"


def write(path: Path, *objs: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump_all(objs))
    return path


SVC = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
       "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}}


def test_static_manifests_give_the_named_nodes_pod_cidrs(tmp_path: Path) -> None:
    write(tmp_path / "svc.yaml", SVC)
    write(tmp_path / "nodes.yaml", node("node-b", ["10.244.2.0/24"]), node("node-a", ["10.244.1.0/24"]))
    assert static_pod_cidrs(tmp_path, "node-a") == nets("10.244.1.0/24")
    assert objects_from([node("node-a", ["10.244.1.0/24"])]).nodes["node-a"].pod_cidrs == nets("10.244.1.0/24")
    cfg = ProxyConfig(services=tmp_path, detect_local_mode="NodeCIDR", hostname_override="node-b")
    facts = asyncio.run(node_facts(cfg))
    assert facts.name == "node-b" and facts.detector.if_local_nft(4) == "ip saddr 10.244.2.0/24"


@pytest.mark.parametrize("objs,name,match", [
    ((SVC,), "node-a", r"--detect-local-mode NodeCIDR \(detectLocalMode\) needs a Node object named 'node-a'"),
    ((node("node-b", ["10.244.2.0/24"]),), "node-a", "needs a Node object named 'node-a'"),
    ((node("node-a"),), "node-a", r"Node node-a: spec.podCIDRs: --detect-local-mode NodeCIDR .* none given"),
    ((node("node-a", ["10.244.1.0/24", "10.244.1.0/99"]),), "node-a", r"Node node-a: spec.podCIDRs\[1\]: "),
    ((node("node-a", ["10.244.1.0/24"]),), None, "needs this node's name: give --hostname-override or NODE_NAME"),
])
def test_static_manifests_without_usable_pod_cidrs_are_config_errors(
        tmp_path: Path, objs: tuple[dict[str, Any], ...], name: str | None, match: str) -> None:
    write(tmp_path / "m.yaml", *objs)
    with pytest.raises(ConfigError, match=match):
        static_pod_cidrs(tmp_path / "m.yaml", name)


def test_a_reload_that_changes_the_pod_cidrs_is_logged_and_not_applied(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = write(tmp_path / "m.yaml", SVC, node("node-a", ["10.244.1.0/24"]))
    facts = NodeFacts("node-a", pod_cidrs=nets("10.244.1.0/24"))
    src = StaticSource(f, Recorder(), node=facts, settle=0.0)
    src.load_initial()
    assert "restart usproxy" not in caplog.text
    write(f, SVC, node("node-a", ["10.244.17.0/24"]))  # another size: the change is seen at once
    assert src.poll()
    assert "Node node-a: spec.podCIDRs now 10.244.17.0/24; detectLocalMode NodeCIDR keeps 10.244.1.0/24" in caplog.text
    assert src.node.pod_cidrs == nets("10.244.1.0/24")
