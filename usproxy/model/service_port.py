"""ServicePort: everything a datapath needs to know about one port of one Service.

Values only (frozen, slotted); built from a parsed Service by `usproxy.model.service.service_ports`.
Addresses are `ipaddress` objects; a dual-stack Service carries one ClusterIP per family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from usproxy.model.datapath_name import DatapathName
from usproxy.model.types import IPNetwork
from usproxy.model.types import IPAddress, Protocol, ServicePortName, format_hostport

SessionAffinity: TypeAlias = Literal["None", "ClientIP"]
TrafficPolicy: TypeAlias = Literal["Cluster", "Local"]
ServiceType: TypeAlias = Literal["ClusterIP", "NodePort", "LoadBalancer"]
LBPolicy: TypeAlias = Literal["roundRobin", "random", "leastConnections"]

DEFAULT_AFFINITY_TIMEOUT = 10800  # seconds, v1.DefaultClientIPServiceAffinitySeconds
MAX_AFFINITY_TIMEOUT = 86400  # seconds, v1.MaxClientIPServiceAffinitySeconds


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One ServicePort (as kube-proxy pkg/proxy/serviceport.go BaseServicePortInfo).

    `cluster_ips` holds one address per IP family (primary first). `node_port` is 0 when the
    Service has none. `affinity_timeout` is in seconds and only meaningful with ClientIP.
    `lb_policy` and `datapath` come from the annotations usproxy.io/lb-policy and
    usproxy.io/datapath (None: use the agent's default). `load_balancer_ips` are the ingress IPs
    of status.loadBalancer with ipMode VIP (or none); `source_ranges` the valid CIDRs of
    spec.loadBalancerSourceRanges, both families (usproxy.model.source_ranges says how they filter). `health_check_node_port` is the
    Service's spec.healthCheckNodePort, non-zero only for a LoadBalancer with
    externalTrafficPolicy Local (as kube-proxy pkg/proxy/service.go, apiservice.NeedsHealthCheck).
    """

    name: ServicePortName
    cluster_ips: tuple[IPAddress, ...]
    port: int
    target_port: int | str
    node_port: int = 0
    service_type: ServiceType = "ClusterIP"
    session_affinity: SessionAffinity = "None"
    affinity_timeout: int = DEFAULT_AFFINITY_TIMEOUT
    external_traffic_policy: TrafficPolicy = "Cluster"
    internal_traffic_policy: TrafficPolicy = "Cluster"
    external_ips: tuple[IPAddress, ...] = ()
    load_balancer_ips: tuple[IPAddress, ...] = ()
    source_ranges: tuple[IPNetwork, ...] = ()
    traffic_distribution: str | None = None
    lb_policy: LBPolicy | None = None
    datapath: DatapathName | None = None
    labels: tuple[tuple[str, str], ...] = field(default=(), compare=True)
    health_check_node_port: int = 0

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    @property
    def cluster_ip(self) -> IPAddress:
        """The primary ClusterIP."""
        return self.cluster_ips[0]

    def frontends(self) -> tuple[tuple[IPAddress, int], ...]:
        """Every (address, port) this ServicePort answers on besides NodePorts."""
        ips = (*self.cluster_ips, *self.external_ips, *self.load_balancer_ips)
        return tuple((ip, self.port) for ip in ips)

    def external_ips_all(self) -> tuple[IPAddress, ...]:
        """externalIPs and LoadBalancer ingress IPs: traffic subject to externalTrafficPolicy."""
        return (*self.external_ips, *self.load_balancer_ips)

    def __str__(self) -> str:
        return f"{format_hostport(self.cluster_ip, self.port)}/{self.protocol}"
