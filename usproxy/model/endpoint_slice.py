"""discovery.k8s.io/v1 EndpointSlice: parse a raw body into Endpoints per ServicePortName.

A slice belongs to the Service named by its `kubernetes.io/service-name` label. Each slice port
(name, protocol, port) yields the endpoints of ServicePortName(ns, service, port name, protocol);
named targetPorts are thus resolved by the slice (the EndpointSlice controller writes the
container port number under the ServicePort's name). Only `addresses[0]` of an endpoint is used,
as kube-proxy does. Conditions: unset ready/serving mean true, unset terminating means false.
Addresses that would turn the proxy into a path to node-local services (loopback, link-local,
multicast, unspecified) are refused with a ConfigError-style log and skipped.
Names are validated as the API server does (the slice's name a DNS-1123 subdomain, its namespace
and port names DNS-1123 labels) and the Service label must name a valid Service (a DNS-1123
label): they reach nftables comments and log lines. A slice with more than MAX_ENDPOINTS endpoints
or MAX_PORTS ports is refused whole, as the API server refuses it (discovery.k8s.io/v1 validation,
pkg/apis/discovery/validation: maxEndpoints, maxPorts): this bounds the work one object costs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from usproxy.model.endpoint import Endpoint, merged
from usproxy.model.fields import Fields, describe, is_dns1123_label
from usproxy.model.types import PROTOCOLS, NamespacedName, Protocol, ServicePortName, refused_address

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
MAX_ENDPOINTS = 1000  # the API server's maxEndpoints per slice
MAX_PORTS = 100  # the API server's maxPorts per slice


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    """A parsed EndpointSlice: its own name, its Service, and endpoints per ServicePortName.

    `endpoints` are merged on construction (endpoint.merged: one per address and port, the ready
    one first, sorted), so a Service with a single slice needs no merge at sync time."""

    name: NamespacedName
    service: NamespacedName
    address_type: str
    endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", {spn: merged([eps]) for spn, eps in self.endpoints.items()})


def _endpoint_base(e: Fields, family: int) -> Endpoint | None:
    addresses = e.str_list("addresses")
    if not addresses:
        raise e.error("addresses", "at least one address is required")
    ip = e.ip("addresses[0]", addresses[0])
    if ip.version != family:
        raise e.error("addresses[0]", f"{ip} does not match the slice's addressType")
    why = refused_address(ip)
    if why is not None:
        log.error("%s: %s.addresses[0]: %s is a %s address, refused", e.obj, e.path, ip, why)
        return None
    cond = e.child("conditions")
    ready, serving, terminating = (cond.opt_bool(k) for k in ("ready", "serving", "terminating"))
    hints = [z.text("name") for z in e.child("hints").items("forZones")]
    return Endpoint(
        ip=ip, port=0,
        ready=ready is not False,
        serving=serving if serving is not None else ready is not False,
        terminating=terminating is True,
        node_name=_shared(e.opt_str("nodeName")), zone=_shared(e.opt_str("zone")), zone_hints=tuple(hints),
    )


def _shared(text: str | None) -> str | None:
    """A node or zone name, interned: a few of them recur in every slice (fields.py)."""
    return None if text is None else sys.intern(text)


def parse_endpoint_slice(raw: Mapping[str, Any]) -> EndpointSlice:
    """Build an EndpointSlice from a raw body. Raises ConfigError naming object and field (e.g. a slice
    with more than MAX_ENDPOINTS endpoints or MAX_PORTS ports)."""
    top = Fields(describe("EndpointSlice", raw), raw)
    meta = top.child("metadata", required=True)
    name = NamespacedName(meta.label("namespace", "default") if meta.data.get("namespace") else "default",
                          meta.subdomain("name"))
    labels = meta.str_map("labels")
    if not labels.get(SERVICE_NAME_LABEL):
        raise meta.error(f"labels[{SERVICE_NAME_LABEL}]", "required: names the slice's Service")
    if not is_dns1123_label(labels[SERVICE_NAME_LABEL]):
        raise meta.error(f"labels[{SERVICE_NAME_LABEL}]",
                         f"must name a Service (a DNS-1123 label), got {labels[SERVICE_NAME_LABEL]!r}")
    service = NamespacedName(name.namespace, sys.intern(labels[SERVICE_NAME_LABEL]))  # its Service's own string
    address_type = top.choice("addressType", ADDRESS_TYPES, "IPv4")
    if address_type == "FQDN":
        return EndpointSlice(name, service, address_type, {})
    family = 4 if address_type == "IPv4" else 6
    bases = [b for b in (_endpoint_base(e, family) for e in top.items("endpoints", MAX_ENDPOINTS)) if b]
    out: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for p in top.items("ports", MAX_PORTS):
        if p.data.get("port") is None:
            continue  # "all ports" slices of selector-less Services carry nothing to proxy
        protocol = cast(Protocol, p.choice("protocol", PROTOCOLS, "TCP"))
        spn = ServicePortName(service.namespace, service.name, p.label("name", ""), protocol)
        port = p.integer("port", lo=1)
        out[spn] = tuple(_with_port(b, port) for b in bases)
    return EndpointSlice(name, service, address_type, out)


def _with_port(base: Endpoint, port: int) -> Endpoint:
    return Endpoint(base.ip, port, base.ready, base.serving, base.terminating,
                    base.node_name, base.zone, base.zone_hints)
