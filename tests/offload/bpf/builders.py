"""ServicePortStates for the BPF tests (no I/O)."""

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


def state(name: ServicePortName, vip: str | tuple[str, ...], port: int, eps: list[Endpoint],
          **kw: Any) -> ServicePortState:
    """A ServicePortState with `eps` categorized as the Proxier does."""
    vips = (vip,) if isinstance(vip, str) else vip
    sp = ServicePort(name=name, cluster_ips=tuple(ipaddress.ip_address(v) for v in vips), port=port,
                     target_port=port, **kw)
    cat = categorize(sp, eps, "node")
    return ServicePortState(sp, tuple(eps), cat.cluster, cat.external)
