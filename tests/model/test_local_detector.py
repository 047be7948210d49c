"""Local-traffic detection and masquerade settings (kube-proxy's detectLocalMode, clusterCIDR,
detectLocal.*, masqueradeAll) from a KubeProxyConfiguration and from flags, the nft matches each
mode gives per family, errors naming the field, and addresses with leading zeros read as
kube-proxy's ParseIPSloppy reads them."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from usproxy.app.cli import build_parser, config_from_args
from usproxy.model.config import ProxyConfig, load_kube_proxy_configuration
from usproxy.model.endpoint_slice import parse_endpoint_slice
from usproxy.util.errors import ConfigError
from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.node import resolve_node
from usproxy.model.service import parse_service
from usproxy.model.types import parse_ip_sloppy


def config(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "kp.yaml"
    f.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n" + body)
    return f


def test_cluster_cidr_and_masquerade_all_from_the_file(tmp_path: Path) -> None:
    cfg = load_kube_proxy_configuration(config(tmp_path, "clusterCIDR: 10.0.0.0/8,fd00:10::/64\n"
                                                         "nftables:\n  masqueradeAll: true\n"))
    node = resolve_node(cfg, kubernetes=False, environ={})
    assert node.masquerade_all
    assert node.detector.if_not_local_nft(4) == "ip saddr != 10.0.0.0/8"
    assert node.detector.if_local_nft(6) == "ip6 saddr fd00:10::/64"


def test_interface_modes_from_the_file_and_flags(tmp_path: Path) -> None:
    f = config(tmp_path, "detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: cbr0\n")
    node = resolve_node(config_from_args(build_parser().parse_args(["run", "--config", str(f)])), kubernetes=False, environ={})
    assert node.detector.if_local_nft(4) == node.detector.if_local_nft(6) == 'iifname "cbr0"'
    args = build_parser().parse_args(["run", "--config", str(f), "--detect-local-mode", "InterfaceNamePrefix",
                                      "--pod-interface-name-prefix", "veth"])
    node = resolve_node(config_from_args(args), kubernetes=False, environ={})
    assert node.detector.if_not_local_nft(4) == 'iifname != "veth*"'


def test_flags_give_cluster_cidr_and_masquerade_all() -> None:
    args = build_parser().parse_args(["run", "--cluster-cidr", "10.244.0.0/16", "--masquerade-all"])
    node = resolve_node(config_from_args(args), kubernetes=False, environ={})
    assert node.masquerade_all and node.detector.if_not_local_nft(4) == "ip saddr != 10.244.0.0/16"
    assert not node.detector.implemented(6)  # no IPv6 CIDR: nothing detected in that family


def test_no_cluster_cidr_is_kube_proxys_no_op_detector() -> None:
    node = resolve_node(ProxyConfig(), kubernetes=False, environ={})
    assert node.detector == LocalDetector() and not node.detector.implemented(4) and not node.masquerade_all


@pytest.mark.parametrize("body,field", [
    ("clusterCIDR: 10.0.0.0/33\n", "clusterCIDR"),
    ("detectLocalMode: Bridge\n", "detectLocalMode"),
    ("detectLocalMode: BridgeInterface\n", "detectLocal.bridgeInterface"),
    ('detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: "ve\\"th"\n', "detectLocal.interfaceNamePrefix"),
    ("iptables:\n  masqueradeAll: yes please\n", "iptables.masqueradeAll"),
])
def test_bad_settings_name_the_field(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_args(build_parser().parse_args(["run", "--config", str(config(tmp_path, body))]))


def test_first_cidr_per_family_is_used_as_kube_proxy() -> None:
    det = local_detector("ClusterCIDR", cluster_cidrs=("10.1.0.0/16", "10.2.0.0/16", "fd00::/64"))
    assert det.cidrs == (ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("fd00::/64"))


def test_leading_zeros_are_decimal_as_parse_ip_sloppy() -> None:
    assert parse_ip_sloppy("010.000.000.001") == ipaddress.ip_address("10.0.0.1")
    with pytest.raises(ValueError):
        parse_ip_sloppy("010.000.000.256")
    svc = parse_service({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
                         "spec": {"clusterIP": "010.096.000.010", "externalIPs": ["192.000.002.050"],
                                  "ports": [{"port": 80}]}})
    (sp,) = svc.ports.values()
    assert sp.cluster_ips == (ipaddress.ip_address("10.96.0.10"),)
    assert sp.external_ips == (ipaddress.ip_address("192.0.2.50"),)
    sl = parse_endpoint_slice({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                               "metadata": {"name": "web-1", "namespace": "default",
                                            "labels": {"kubernetes.io/service-name": "web"}},
                               "endpoints": [{"addresses": ["010.244.001.005"]}], "ports": [{"port": 8080}]})
    assert [str(e.ip) for eps in sl.endpoints.values() for e in eps] == ["10.244.1.5"]
