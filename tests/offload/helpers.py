"""Builders of ServicePortStates for offload tests (no I/O)."""

from __future__ import annotations

import ipaddress
from typing import Any

from usproxy.datapath import ServicePortState
from usproxy.endpoint import Endpoint, categorize
from usproxy.service_port import ServicePort
from usproxy.types import Protocol, ServicePortName


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
    return ServicePortState(sp, tuple(eps), cat.cluster, cat.external)
