"""Builders of ServicePortStates for offload tests (no I/O)."""

from __future__ import annotations

import ipaddress
from typing import Any

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint, categorize
from usproxy.model.service_port import ServicePort
from usproxy.model.types import Protocol, ServicePortName


def spn(name: str, port: str = "", proto: Protocol = "TCP", ns: str = "default") -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def ep(addr: str, port: int = 8080, **kw: Any) -> Endpoint:
    return Endpoint(ipaddress.ip_address(addr), port, **kw)


def state(name: ServicePortName, vip: str, port: int, eps: list[Endpoint], **kw: Any) -> ServicePortState:
    """A ServicePortState with `eps` categorized as the Proxier does (node name "node")."""
    ips = kw.pop("cluster_ips", None) or (ipaddress.ip_address(vip),)
    ext = tuple(ipaddress.ip_address(a) for a in kw.pop("external_ips", ()))
    sp = ServicePort(name=name, cluster_ips=tuple(ips), port=port, target_port=port,
                     external_ips=ext, **kw)
    cat = categorize(sp, eps, "node")
    short = cat.cluster_policy if sp.external_traffic_policy == "Local" else ()
    return ServicePortState(sp, tuple(eps), cat.cluster, cat.external, short)


def every_feature() -> dict[ServicePortName, ServicePortState]:
    """ServicePorts that together use every part of the nftables layout, in both families: shared
    group chains with and without masquerade, NodePorts, external IPs, traffic policy Local,
    ClientIP affinity (with masquerade), lb-policy roundRobin (with and without affinity), a
    ServicePort without endpoints, UDP, IPv6 and dual-stack, and endpoints shared by ServicePorts
    (hairpin elements counted twice)."""
    v4, v6 = [ep("10.244.1.1", node_name="node"), ep("10.244.2.1")], [ep("2001:db8:244::1"), ep("2001:db8:244::2")]
    specs: list[tuple[str, str, str, list[Endpoint], dict[str, Any]]] = [
        ("web", "http", "10.96.0.1", v4, {"node_port": 30080, "service_type": "NodePort", "external_ips": ["192.0.2.50"]}),
        ("one", "", "10.96.0.2", v4[:1], {}),
        ("local", "", "10.96.0.3", [*v4, ep("10.244.3.1", node_name="other")],
         {"node_port": 30003, "service_type": "NodePort", "external_traffic_policy": "Local"}),
        ("sticky", "", "10.96.0.4", v4, {"session_affinity": "ClientIP", "affinity_timeout": 30,
                                         "node_port": 30004, "service_type": "NodePort"}),
        ("rr", "", "10.96.0.5", [*v4, ep("10.244.3.1")], {"lb_policy": "roundRobin", "node_port": 30005,
                                                          "service_type": "NodePort"}),
        ("rr-sticky", "", "10.96.0.6", v4, {"lb_policy": "roundRobin", "session_affinity": "ClientIP"}),
        ("empty", "", "10.96.0.7", [], {"node_port": 30007, "service_type": "NodePort"}),
        ("v6", "", "2001:db8:96::1", v6, {"node_port": 30008, "service_type": "NodePort"}),
        ("dual", "", "10.96.0.9", [*v4, *v6], {"cluster_ips": [ipaddress.ip_address("10.96.0.9"),
                                                               ipaddress.ip_address("2001:db8:96::9")]}),
    ]
    out = {spn(name, port): state(spn(name, port), vip, 80, eps, **kw) for name, port, vip, eps, kw in specs}
    dns = spn("dns", "dns", "UDP")
    out[dns] = state(dns, "10.96.0.10", 53, [ep("10.244.1.1", 53), ep("10.244.2.1", 53)])
    return out
