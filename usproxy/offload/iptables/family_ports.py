"""The generator's FamilyPort from the ServicePortState a sync hands the datapath.

`usproxy explain` builds FamilyPorts from manifests (model.service_set.family_port, which
categorizes the endpoints itself); the datapath builds them from what the Proxier decided, so
traffic policies and topology hints (the node's zone, which explain does not know) are applied
once, in the core, for every datapath. The generator needs two endpoint lists: the Cluster
policy's (`cluster`) and the Local policy's (`local`), in kube-proxy's order (by "ip:port"):

- Cluster policy: the ClusterIP endpoints when internalTrafficPolicy is Cluster, else the
  external ones when externalTrafficPolicy is Cluster, else the short-circuit endpoints (which
  are the Cluster policy's endpoints of an externalTrafficPolicy Local ServicePort);
- Local policy: the ClusterIP endpoints when internalTrafficPolicy is Local, else the external
  ones when externalTrafficPolicy is Local (neither: no Local chain is used).
"""

from __future__ import annotations

from collections.abc import Iterable

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.service_set import FamilyPort
from usproxy.model.types import Family
from usproxy.model.source_ranges import family_ranges
from usproxy.model.types import IPAddress


def family_port_of(state: ServicePortState, family: Family) -> FamilyPort | None:
    """`state` as the `family` proxier sees it; None when it has no ClusterIP of that family."""
    sp = state.service_port
    cluster_ip = next((ip for ip in sp.cluster_ips if ip.version == family), None)
    if cluster_ip is None:
        return None
    if sp.internal_traffic_policy == "Cluster":
        cluster, local = state.cluster_endpoints, state.external_endpoints
    else:
        cluster, local = state.short_circuit_endpoints, state.cluster_endpoints
    if sp.external_traffic_policy == "Cluster" and sp.internal_traffic_policy == "Local":
        cluster = state.external_endpoints
    elif sp.internal_traffic_policy == "Cluster" and sp.external_traffic_policy == "Cluster":
        local = ()
    eps = _of(family, state.endpoints)
    return FamilyPort(
        sp=sp, family=family, cluster_ip=cluster_ip,
        external_ips=_ips(family, sp.external_ips), lb_ips=_ips(family, sp.load_balancer_ips),
        endpoints=eps, cluster=_of(family, cluster), local=_of(family, local),
        has_endpoints=bool(usable(eps)), source_ranges=family_ranges(sp.source_ranges, family),
    )


def _of(family: Family, eps: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    return tuple(sorted((ep for ep in eps if ep.ip.version == family), key=str))


def _ips(family: Family, ips: Iterable[IPAddress]) -> tuple[IPAddress, ...]:
    return tuple(ip for ip in ips if ip.version == family)
