"""v1 Service: parse a raw body into ServicePorts, and decide which Services the proxy skips.

Skipped, as kube-proxy pkg/proxy/util ShouldSkipService and its service-proxy-name filter:
headless Services (clusterIP None), ExternalName Services, and Services labelled
`service.kubernetes.io/service-proxy-name` unless the label names usproxy. Every other problem is
a ConfigError naming the Service and the field.

Names are validated as the API server does (pkg/apis/core/validation: the namespace a DNS-1123
label, the Service name a DNS-1123 label (DNS-1035 labels, and the relaxed Service names of
newer API servers, are such labels), each port name a DNS-1123 label), because they reach
nftables comments and log lines: a name outside that alphabet refuses the Service.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from usproxy.model.datapath_name import DATAPATH_NAMES, DatapathName
from usproxy.model.fields import Fields, describe
from usproxy.model.service_port import (
    DEFAULT_AFFINITY_TIMEOUT,
    MAX_AFFINITY_TIMEOUT,
    LBPolicy,
    ServicePort,
    ServiceType,
    SessionAffinity,
    TrafficPolicy,
)
from usproxy.model.source_ranges import parse_source_ranges
from usproxy.model.types import PROTOCOLS, IPAddress, NamespacedName, Protocol, ServicePortName, refused_address

log = logging.getLogger(__name__)

PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
PROXY_NAME = "usproxy"
LB_POLICY_ANNOTATION = "usproxy.io/lb-policy"
DATAPATH_ANNOTATION = "usproxy.io/datapath"
_IANA_NAME = re.compile(r"(?=.*[a-z])[a-z0-9](?:[a-z0-9-]{0,13}[a-z0-9])?")  # as validation.IsValidPortName
LB_POLICIES = ("roundRobin", "random", "leastConnections")


@dataclass(frozen=True, slots=True)
class Service:
    """A parsed Service: its name and its ServicePorts keyed by ServicePortName."""

    name: NamespacedName
    ports: Mapping[ServicePortName, ServicePort]


def skip_reason(raw: Mapping[str, Any]) -> str | None:
    """Why kube-proxy would ignore this Service, or None when it must be proxied."""
    spec = raw.get("spec") or {}
    meta = raw.get("metadata") or {}
    labels = meta.get("labels") or {} if isinstance(meta, Mapping) else {}
    if isinstance(labels, Mapping) and labels.get(PROXY_NAME_LABEL) not in (None, PROXY_NAME):
        return f"labelled {PROXY_NAME_LABEL}={labels.get(PROXY_NAME_LABEL)}"
    if isinstance(spec, Mapping) and spec.get("type") == "ExternalName":
        return "type ExternalName"
    if isinstance(spec, Mapping) and spec.get("clusterIP") == "None":
        return "headless (clusterIP None)"
    return None


def _cluster_ips(spec: Fields) -> tuple[IPAddress, ...]:
    texts = spec.str_list("clusterIPs") or ([spec.text("clusterIP")] if spec.data.get("clusterIP") else [])
    if not texts:
        raise spec.error("clusterIP", "required (usproxy does not allocate ClusterIPs)")
    ips = tuple(_frontend_ip(spec, f"clusterIPs[{i}]", t) for i, t in enumerate(texts))
    if len({ip.version for ip in ips}) != len(ips):
        raise spec.error("clusterIPs", "at most one address per IP family")
    single = spec.data.get("clusterIP")
    if single and spec.data.get("clusterIPs") and str(single) != texts[0]:
        raise spec.error("clusterIP", f"{single} differs from clusterIPs[0] {texts[0]}")
    return ips


def _frontend_ip(f: Fields, field: str, text: object) -> IPAddress:
    """A Service address the proxy will answer on: never loopback, link-local, multicast or
    unspecified (binding those would capture node-local services or every address)."""
    ip = f.ip(field, text)
    why = refused_address(ip)
    if why:
        raise f.error(field, f"{ip} is a {why} address")
    return ip


def _same_family(
    spec: Fields, field: str, texts: list[str], families: set[Literal[4, 6]]
) -> tuple[IPAddress, ...]:
    """Parse addresses; those of a family the Service does not have are logged and skipped."""
    out = []
    for i, text in enumerate(texts):
        ip = _frontend_ip(spec, f"{field}[{i}]", text)
        if ip.version not in families:
            log.warning("%s: %s[%d]: %s is not of the Service's IP families, skipped",
                        spec.obj, field, i, ip)
            continue
        out.append(ip)
    return tuple(out)


def _vip_ingress(top: Fields) -> list[str]:
    """status.loadBalancer.ingress IPs the proxy programs: those with ipMode VIP (or unset).
    An ingress with ipMode Proxy is a load balancer that proxies to the nodes itself, so its IP
    is not served here, as kube-proxy (pkg/proxy/serviceport.go, proxyutil.IsVIPMode)."""
    out = []
    for ing in top.child("status").child("loadBalancer").items("ingress"):
        if ing.data.get("ip") and ing.opt_str("ipMode") in (None, "VIP"):
            out.append(ing.data["ip"])
    return out


def _affinity(spec: Fields) -> tuple[SessionAffinity, int]:
    affinity = cast(SessionAffinity, spec.choice("sessionAffinity", ("None", "ClientIP"), "None"))
    cfg = spec.child("sessionAffinityConfig").child("clientIP")
    timeout = cfg.integer("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT, lo=1, hi=MAX_AFFINITY_TIMEOUT)
    return affinity, timeout


def _port(p: Fields, svc: NamespacedName, many: bool) -> tuple[ServicePortName, int, int | str, int]:
    name = p.label("name", "")
    if many and not name:
        raise p.error("name", "required when a Service has more than one port")
    protocol = cast(Protocol, p.choice("protocol", PROTOCOLS, "TCP"))
    port = p.integer("port", lo=1)
    raw_target = p.data.get("targetPort", port)
    target: int | str
    if isinstance(raw_target, str) and not (raw_target.isascii() and raw_target.isdigit()):
        if not _IANA_NAME.fullmatch(raw_target) or raw_target.isdigit():
            raise p.error("targetPort", f"must be a port number or an IANA port name, got {raw_target!r}")
        target = raw_target
    elif isinstance(raw_target, str):
        target = Fields(p.obj, {"targetPort": int(raw_target)}, p.path).integer("targetPort", lo=1)
    else:
        target = p.integer("targetPort", port, lo=1)
    node_port = p.integer("nodePort", 0)
    return ServicePortName(svc.namespace, svc.name, name, protocol), port, target, node_port


def parse_service(raw: Mapping[str, Any]) -> Service:
    """Build a Service from a raw v1 Service body. Raises ConfigError naming object and field.

    Call `skip_reason` first: this function expects a Service the proxy must serve. Fields are
    read in a fixed order (the first bad one is the one reported), and each ServicePort is built
    with explicit arguments, so the type checker checks every field of the model's constructor.
    """
    top = Fields(describe("Service", raw), raw)
    meta = top.child("metadata", required=True)
    svc = NamespacedName(meta.label("namespace", "default") if meta.data.get("namespace") else "default",
                         meta.label("name"))
    spec = top.child("spec", required=True)
    stype = cast(ServiceType, spec.choice("type", ("ClusterIP", "NodePort", "LoadBalancer"), "ClusterIP"))
    cluster_ips = _cluster_ips(spec)
    families = {ip.version for ip in cluster_ips}
    ingress = _vip_ingress(top)
    affinity, timeout = _affinity(spec)
    annotations = meta.str_map("annotations")
    etp = _traffic_policy(spec, "externalTrafficPolicy")
    itp = _traffic_policy(spec, "internalTrafficPolicy")
    external_ips = _same_family(spec, "externalIPs", spec.str_list("externalIPs"), families)
    balanced = stype == "LoadBalancer"
    lb_ips = _same_family(top, "status.loadBalancer.ingress", ingress, families) if balanced else ()
    ranges = parse_source_ranges(spec.obj, "spec.loadBalancerSourceRanges",
                                 spec.str_list("loadBalancerSourceRanges")) if balanced else ()
    distribution = spec.opt_str("trafficDistribution")
    lb_policy = cast(LBPolicy | None, _annotation(meta, annotations, LB_POLICY_ANNOTATION, LB_POLICIES))
    datapath = cast(DatapathName | None, _annotation(meta, annotations, DATAPATH_ANNOTATION, DATAPATH_NAMES))
    labels = tuple(sorted(meta.str_map("labels").items()))
    health_check = _health_check_node_port(spec, stype, etp)
    ports: dict[ServicePortName, ServicePort] = {}
    for spn, port, target, node_port in _ports(spec, svc, stype):
        ports[spn] = ServicePort(
            name=spn, cluster_ips=cluster_ips, port=port, target_port=target, node_port=node_port,
            service_type=stype, session_affinity=affinity, affinity_timeout=timeout,
            external_traffic_policy=etp, internal_traffic_policy=itp, external_ips=external_ips,
            load_balancer_ips=lb_ips, source_ranges=ranges, traffic_distribution=distribution,
            lb_policy=lb_policy, datapath=datapath, labels=labels, health_check_node_port=health_check)
    return Service(svc, ports)


def _traffic_policy(spec: Fields, key: str) -> TrafficPolicy:
    return cast(TrafficPolicy, spec.choice(key, ("Cluster", "Local"), "Cluster"))


def _ports(spec: Fields, svc: NamespacedName, stype: ServiceType) -> list[tuple[ServicePortName, int, int | str, int]]:
    """(name, port, targetPort, nodePort) of each of spec.ports; at least one, no duplicates."""
    port_fields = spec.items("ports")
    if not port_fields:
        raise spec.error("ports", "at least one port is required")
    out: dict[ServicePortName, tuple[ServicePortName, int, int | str, int]] = {}
    for p in port_fields:
        spn, port, target, node_port = _port(p, svc, len(port_fields) > 1)
        if spn in out:
            raise p.error("name", f"duplicate port {spn.port!r}/{spn.protocol}")
        if node_port and stype == "ClusterIP":
            node_port = 0  # the API server clears it; a hand-written file may not
        out[spn] = (spn, port, target, node_port)
    return list(out.values())


def _health_check_node_port(spec: Fields, stype: ServiceType, etp: TrafficPolicy) -> int:
    """spec.healthCheckNodePort (1..65535; absent or 0: none), kept only where kube-proxy serves
    it (apiservice.NeedsHealthCheck: type LoadBalancer, externalTrafficPolicy Local); such a
    Service without one is logged, as kube-proxy pkg/proxy/service.go does. Raises ConfigError."""
    raw = spec.data.get("healthCheckNodePort")
    unset = raw is None or (raw == 0 and not isinstance(raw, bool))
    port = 0 if unset else spec.integer("healthCheckNodePort", lo=1)
    if stype != "LoadBalancer" or etp != "Local":
        return 0
    if not port:
        log.warning("%s: LoadBalancer with externalTrafficPolicy Local has no spec.healthCheckNodePort; "
                    "no health check is served", spec.obj)
    return port


def _annotation(meta: Fields, annotations: dict[str, str], key: str, choices: tuple[str, ...]) -> str | None:
    value = annotations.get(key)
    if value is None:
        return None
    if value not in choices:
        raise meta.error(f"annotations[{key}]", f"must be one of {', '.join(choices)}, got {value!r}")
    return value
