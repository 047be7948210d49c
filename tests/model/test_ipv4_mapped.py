"""IPv4-mapped IPv6 addresses and ranges (::ffff:192.0.2.20, ::ffff:192.0.2.0/120) read as the IPv4
ones they carry, by every parser of addresses and CIDRs in usproxy (issue 29 item 5), as Go's
net.IP and kube-proxy's IPFamilyOf/IPFamilyOfCIDR read them.

Before, each was classed IPv6, and an IPv6 entry is ignored by the IPv4 side of every check, so
the check failed open: a mapped loadBalancerSourceRange left the IPv4 LB IP unfiltered, a mapped
--nodeport-addresses CIDR left IPv4 NodePorts on every address, a mapped --service-cidr or
ServiceCIDR dropped nothing, a mapped --cluster-cidr or podCIDR detected no pod, a mapped
loopback endpoint or externalIP passed the loopback refusal. The traffic tests of the source
ranges are tests/offload/test_mapped_source_ranges.py."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from usproxy.app.cli import build_parser, config_from_args
from usproxy.explain.cli import build_parser as explain_parser
from usproxy.explain.cli import node_from
from usproxy.model.config import ProxyConfig, parse_cidrs, parse_nodeport_addresses
from usproxy.model.endpoint_slice import parse_endpoint_slice
from usproxy.model.local_detector import local_detector
from usproxy.model.manifest import objects_from
from usproxy.model.node import parse_node_pod_cidrs, resolve_node
from usproxy.model.service import parse_service
from usproxy.model.service_cidr import parse_service_cidr
from usproxy.model.source_ranges import allowed_sources, family_ranges
from usproxy.model.types import parse_cidr_sloppy, parse_ip_sloppy, unmapped, unmapped_network
from usproxy.relay import source_filter
from usproxy.relay.port_holder import holding_sockets
from usproxy.util.errors import ConfigError

V4 = ipaddress.IPv4Address
N4 = ipaddress.IPv4Network


@pytest.mark.parametrize("text,want", [
    ("::ffff:192.0.2.20/128", "192.0.2.20/32"),
    ("::ffff:192.0.2.0/120", "192.0.2.0/24"),
    ("::ffff:c000:214/128", "192.0.2.20/32"),  # the same address written in hex
    (" ::FFFF:203.0.113.7/121 ", "203.0.113.0/25"),  # host bits and case, as ParseCIDRSloppy
    ("::ffff:0:0/96", "0.0.0.0/0"),  # the whole mapped space: every IPv4 address
    ("::ffff:192.0.2.20/88", "::ff00:0:0/88"),  # shorter than /96: no longer mapped, IPv6 as in Go
    ("::192.0.2.20/128", "::c000:214/128"),  # IPv4-compatible (deprecated) is IPv6, as in Go
    ("2001:db8::/32", "2001:db8::/32"),
    ("010.244.000.000/16", "10.244.0.0/16"),
])
def test_cidrs_are_read_per_family_as_kube_proxy(text: str, want: str) -> None:
    assert str(parse_cidr_sloppy(text)) == want


def test_addresses_are_read_per_family_as_kube_proxy() -> None:
    assert parse_ip_sloppy("::ffff:192.0.2.20") == V4("192.0.2.20")
    assert parse_ip_sloppy("::ffff:127.0.0.1").is_loopback  # Python 3.11's IPv6Address says False
    assert parse_ip_sloppy("2001:db8::1").version == 6
    assert unmapped(ipaddress.ip_address("::ffff:10.0.0.1")) == V4("10.0.0.1")
    assert unmapped_network(ipaddress.ip_network("2001:db8::/64")) == ipaddress.ip_network("2001:db8::/64")


def lb(ranges: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "ports": [{"port": 80, "nodePort": 30080}],
                     "loadBalancerSourceRanges": ranges},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}}


def test_a_mapped_source_range_filters_the_ipv4_lb_ip() -> None:
    """The issue's case: `::ffff:192.0.2.20/128` was IPv6, so the IPv4 LB IP had no range left
    and every client was allowed (family_ranges(…, 4) empty); it is 192.0.2.20/32."""
    sp = next(iter(parse_service(lb(["::ffff:192.0.2.20/128"])).ports.values()))
    assert sp.source_ranges == (N4("192.0.2.20/32"),)
    assert family_ranges(sp.source_ranges, 4) == (N4("192.0.2.20/32"),)
    assert family_ranges(sp.source_ranges, 6) == ()
    assert allowed_sources(sp.source_ranges, 4, sp.load_balancer_ips, ()) == (N4("192.0.2.20/32"),)
    whole = next(iter(parse_service(lb(["::ffff:0:0/96"])).ports.values()))
    assert family_ranges(whole.source_ranges, 4) == ()  # 0.0.0.0/0: allow any, as kube-proxy


def test_service_frontends_of_mapped_addresses_are_ipv4_and_refused_where_ipv4_would_be() -> None:
    raw = lb([])
    raw["spec"].update(clusterIP="::ffff:10.96.0.10", clusterIPs=["::ffff:10.96.0.10"],
                       externalIPs=["::ffff:198.51.100.4"])
    raw["status"]["loadBalancer"]["ingress"] = [{"ip": "::ffff:198.51.100.1"}]
    sp = next(iter(parse_service(raw).ports.values()))
    assert sp.cluster_ips == (V4("10.96.0.10"),)
    assert sp.external_ips == (V4("198.51.100.4"),) and sp.load_balancer_ips == (V4("198.51.100.1"),)
    raw["spec"]["externalIPs"] = ["::ffff:127.0.0.1"]  # would capture the node's own loopback services
    with pytest.raises(ConfigError, match=r"spec.externalIPs\[0\]: 127.0.0.1 is a loopback address"):
        parse_service(raw)


def slice_(address_type: str, address: str) -> dict[str, Any]:
    return {"metadata": {"name": "web-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": address_type, "ports": [{"port": 8080}],
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}]}


def test_a_mapped_endpoint_address_is_ipv4_so_a_mapped_loopback_is_never_dialed() -> None:
    """An IPv6 slice naming ::ffff:127.0.0.1 was dialed from an IPv6 socket, which reaches the
    node's own 127.0.0.1: now it is an IPv4 address in an IPv6 slice, refused naming the field."""
    assert [ep.ip for eps in parse_endpoint_slice(slice_("IPv4", "::ffff:10.244.1.5")).endpoints.values()
            for ep in eps] == [V4("10.244.1.5")]
    with pytest.raises(ConfigError, match=r"addresses\[0\]: 127.0.0.1 does not match the slice's addressType"):
        parse_endpoint_slice(slice_("IPv6", "::ffff:127.0.0.1"))
    assert not [ep for eps in parse_endpoint_slice(slice_("IPv4", "::ffff:127.0.0.1")).endpoints.values()
                for ep in eps]  # refused as loopback, as 127.0.0.1 is


def test_service_cidr_objects_and_flags() -> None:
    sc = parse_service_cidr({"metadata": {"name": "extra"}, "spec": {"cidrs": ["::ffff:10.96.0.0/112"]}})
    assert sc.cidrs == (N4("10.96.0.0/16"),)
    args = build_parser().parse_args(["run", "--service-cidr", "::ffff:10.96.0.0/112",
                                      "--cluster-cidr", "::ffff:10.244.0.0/112"])
    cfg = config_from_args(args)
    assert parse_cidrs(cfg.service_cidrs, "--service-cidr") == (N4("10.96.0.0/16"),)
    detector = resolve_node(cfg, kubernetes=False, environ={}).detector
    assert detector.if_not_local_nft(4) == "ip saddr != 10.244.0.0/16"  # was: no IPv4 detector at all
    assert not detector.implemented(6)
    assert local_detector("ClusterCIDR", cluster_cidrs=("::ffff:10.244.0.0/112",)).cidrs == (N4("10.244.0.0/16"),)


def test_nodeport_addresses_limit_ipv4_nodeports() -> None:
    """A mapped CIDR used to restrict IPv6 only, so IPv4 NodePorts stayed on every address."""
    cidrs = parse_nodeport_addresses(("::ffff:192.0.2.0/120",))
    assert cidrs == (N4("192.0.2.0/24"),)
    node = resolve_node(ProxyConfig(nodeport_addresses=("::ffff:192.0.2.0/120",)), kubernetes=False, environ={})
    local = [("eth0", V4("192.0.2.10")), ("eth1", V4("198.51.100.4")), ("eth0", ipaddress.ip_address("2001:db8::1"))]
    assert [str(ip) for ip in node.nodeport_ips(local, "usproxy0")] == ["192.0.2.10", "2001:db8::1"]


def test_node_pod_cidrs() -> None:
    raw = {"kind": "Node", "metadata": {"name": "node-a"}, "spec": {"podCIDRs": ["::ffff:10.244.1.0/120"]}}
    assert parse_node_pod_cidrs(raw).pod_cidrs == (N4("10.244.1.0/24"),)


def test_manifests_with_mapped_addresses_load_as_ipv4(tmp_path: Path) -> None:
    svc = lb(["::ffff:203.0.113.0/121"])
    svc.update(apiVersion="v1", kind="Service")
    eps = slice_("IPv4", "::ffff:10.244.1.5")
    eps.update(apiVersion="discovery.k8s.io/v1", kind="EndpointSlice")
    m = objects_from([svc, eps])
    (sp,) = [p for s in m.services.values() for p in s.ports.values()]
    (eps_,) = m.slices.values()
    assert sp.source_ranges == (N4("203.0.113.0/25"),)
    assert [ep.ip for e in eps_.endpoints.values() for ep in e] == [V4("10.244.1.5")]


def test_the_relays_source_check_reads_a_dual_stack_peer_as_ipv4() -> None:
    ranges = (N4("203.0.113.0/25"),)
    assert source_filter.allows(ranges, "::ffff:203.0.113.2")
    assert not source_filter.allows(ranges, "::ffff:203.0.113.130")


def test_a_socket_bound_to_a_mapped_clusterip_is_named_as_its_holder(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (net / "tcp").write_text(head)
    # [::ffff:10.96.6.6]:2222 listening (0A), inode 4242: /proc/net/tcp6 prints four 32-bit
    # words, each in host (little-endian) order
    mapped = "00000000" + "00000000" + "FFFF0000" + "0606600A"
    (net / "tcp6").write_text(head + f"   0: {mapped}:08AE 00000000000000000000000000000000:0000 0A "
                                     "00000000:00000000 00:00000000 00000000     0        0 4242 1\n")
    assert holding_sockets("10.96.6.6", 2222, "TCP", tmp_path) == [("10.96.6.6", 4242)]


def test_explain_reads_node_flags_as_the_agent() -> None:
    args = explain_parser().parse_args(["--services", "x", "--node-ip", "::ffff:192.0.2.10",
                                        "--cluster-cidr", "::ffff:10.244.0.0/112"])
    node = node_from(args)
    assert node.ips == (V4("192.0.2.10"),)
    assert node.cluster_cidrs == (N4("10.244.0.0/16"),)
