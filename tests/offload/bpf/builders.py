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


WEB, QUIC = spn("web"), spn("quic", "", "UDP")


def web_and_quic() -> dict[ServicePortName, ServicePortState | None]:
    """web (TCP 80) and quic (UDP 4433), two endpoints each: what test_restart's agent installs."""
    return {
        WEB: state(WEB, "10.96.150.150", 80, [ep("10.244.1.50"), ep("10.244.2.50")]),
        QUIC: state(QUIC, "10.96.150.151", 4433, [ep("10.244.3.50", 4433), ep("10.244.4.50", 4433)]),
    }
