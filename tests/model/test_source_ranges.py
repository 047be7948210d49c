"""spec.loadBalancerSourceRanges and status.loadBalancer.ingress ipMode, parsed as kube-proxy
(pkg/proxy/serviceport.go, MapCIDRsByIPFamily, IsVIPMode): whitespace trimmed, host bits allowed,
an invalid entry ignored with a warning naming the Service and the field (the Service is still
served), a malformed field refused naming it; per family, 0.0.0.0/0 means allow any; the LB IPs
are allowed sources when a range holds a node address."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import pytest

from usproxy.util.errors import ConfigError
from usproxy.model.service import parse_service
from usproxy.model.source_ranges import allowed_sources, family_ranges


def lb(ranges: Any, ingress: list[dict[str, Any]] | None = None, stype: str = "LoadBalancer") -> dict[str, Any]:
    return {"metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": stype, "clusterIP": "10.96.0.10", "ports": [{"port": 80, "nodePort": 30080}],
                     "loadBalancerSourceRanges": ranges},
            "status": {"loadBalancer": {"ingress": ingress if ingress is not None else [{"ip": "198.51.100.1"}]}}}


def only_port(raw: dict[str, Any]) -> Any:
    return next(iter(parse_service(raw).ports.values()))


def test_ranges_are_trimmed_and_host_bits_allowed() -> None:
    sp = only_port(lb([" 203.0.113.0/25", "192.168.0.7/24 ", "2001:db8::/64"]))
    assert [str(n) for n in sp.source_ranges] == ["203.0.113.0/25", "192.168.0.0/24", "2001:db8::/64"]


def test_leading_zeros_are_read_as_kube_proxy_reads_them() -> None:
    """ParseCIDRSloppy: "192.000.002.002/32" is 192.0.2.2/32, not an invalid range (which would be
    ignored, and with it the whole filter: everyone allowed)."""
    sp = only_port(lb(["192.000.002.002/32"]))
    assert [str(n) for n in sp.source_ranges] == ["192.0.2.2/32"]


def test_an_invalid_range_is_ignored_with_a_warning_naming_service_and_field(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        sp = only_port(lb(["203.0.113.0/25", "203.0.113.0/33", "bogus", ""]))
    assert [str(n) for n in sp.source_ranges] == ["203.0.113.0/25"]
    text = caplog.text
    assert "Service shop/web: spec.loadBalancerSourceRanges[1]: not a valid CIDR: '203.0.113.0/33'" in text
    assert "spec.loadBalancerSourceRanges[2]: not a valid CIDR: 'bogus'" in text
    assert "[3]" not in text  # an empty entry is ignored silently, as kube-proxy


def test_a_malformed_field_refuses_the_service_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"Service shop/web: spec.loadBalancerSourceRanges: must be a list of strings"):
        parse_service(lb("203.0.113.0/25"))


def test_ranges_only_for_load_balancers() -> None:
    assert only_port(lb(["203.0.113.0/25"], stype="NodePort")).source_ranges == ()


def test_ingress_with_ip_mode_proxy_is_not_served() -> None:
    sp = only_port(lb([], [{"ip": "198.51.100.1", "ipMode": "VIP"}, {"ip": "198.51.100.2", "ipMode": "Proxy"},
                           {"ip": "198.51.100.3"}, {"hostname": "lb.example"}]))
    assert [str(ip) for ip in sp.load_balancer_ips] == ["198.51.100.1", "198.51.100.3"]


def test_per_family_and_zero_prefix() -> None:
    ranges = [ipaddress.ip_network(t) for t in ("203.0.113.0/25", "2001:db8::/64")]
    assert [str(n) for n in family_ranges(ranges, 4)] == ["203.0.113.0/25"]
    assert family_ranges([ipaddress.ip_network("0.0.0.0/0"), *ranges], 4) == ()  # allow any
    assert [str(n) for n in family_ranges([ipaddress.ip_network("0.0.0.0/0"), *ranges], 6)] == ["2001:db8::/64"]


def test_lb_ips_are_allowed_when_a_range_holds_a_node_address() -> None:
    ranges = [ipaddress.ip_network("192.168.0.0/24")]
    lbs = [ipaddress.ip_address("198.51.100.1")]
    node = [ipaddress.ip_address("192.168.0.2")]
    assert [str(n) for n in allowed_sources(ranges, 4, lbs, node)] == ["192.168.0.0/24", "198.51.100.1/32"]
    assert [str(n) for n in allowed_sources(ranges, 4, lbs, [ipaddress.ip_address("10.0.0.1")])] == ["192.168.0.0/24"]
