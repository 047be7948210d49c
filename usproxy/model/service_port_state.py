"""ServicePortState: one ServicePort with its endpoints after the traffic policies, the value a
sync hands every datapath (usproxy/core/datapath.py SyncRequest) and the stale-UDP rule reads."""

from __future__ import annotations

from dataclasses import dataclass

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port import ServicePort


@dataclass(frozen=True, slots=True)
class ServicePortState:
    """One ServicePort with its endpoints, after traffic policies (see endpoint.categorize).

    `cluster_endpoints` serve traffic to ClusterIPs; `external_endpoints` serve NodePorts,
    externalIPs and LoadBalancer IPs. Either may be empty: then that traffic must be refused.
    `short_circuit_endpoints` (externalTrafficPolicy Local only) serve traffic from pods and from
    the node itself to the external addresses: every endpoint of the Cluster policy, as
    kube-proxy's "short-circuit" rules (pkg/proxy/nftables/proxier.go, external traffic chain).
    """

    service_port: ServicePort
    endpoints: tuple[Endpoint, ...]
    cluster_endpoints: tuple[Endpoint, ...]
    external_endpoints: tuple[Endpoint, ...]
    short_circuit_endpoints: tuple[Endpoint, ...] = ()
