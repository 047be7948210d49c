"""Model builders of the core tests (tests/core, tests/admin): one-port Services and their
EndpointSlices, in namespace default."""

from __future__ import annotations

import ipaddress

from usproxy.model.endpoint import Endpoint
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.model.service import Service
from usproxy.model.service_port import ServicePort
from usproxy.model.types import NamespacedName, ServicePortName


def spn(name: str) -> ServicePortName:
    return ServicePortName("default", name, "", "TCP")


def service(name: str, ip: str, **kw: object) -> Service:
    p = spn(name)
    return Service(NamespacedName("default", name),
                   {p: ServicePort(p, (ipaddress.ip_address(ip),), 80, 8080, **kw)})  # type: ignore[arg-type]


def eps(name: str, *ips: str, node: str | None = None, ready: bool = True) -> EndpointSlice:
    e = tuple(Endpoint(ipaddress.ip_address(i), 8080, ready=ready, node_name=node) for i in ips)
    return EndpointSlice(NamespacedName("default", name + "-1"), NamespacedName("default", name), "IPv4", {spn(name): e})
