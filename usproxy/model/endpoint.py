"""Endpoint: one backend address of a ServicePort, and which endpoints are usable.

Conditions follow EndpointSlice semantics (discovery.k8s.io/v1): `ready` and `serving` default to
true when unset, `terminating` to false. Usable endpoints are the ready ones; if none is ready,
the serving and terminating ones (as kube-proxy pkg/proxy/topology.go CategorizeEndpoints).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from usproxy.model.service_port import ServicePort
from usproxy.model.types import IPAddress, format_hostport


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One endpoint of one ServicePort: address, port and EndpointSlice conditions."""

    ip: IPAddress
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    zone: str | None = None
    zone_hints: tuple[str, ...] = ()
    # `ip` as text, made once: the relay dials and records it for every connection, and
    # ipaddress's __str__ costs ~2 us each time. Not compared: derived from `ip`.
    host: str = field(init=False, compare=False, repr=False)
    # The hash, made on first use: the relay hashes an endpoint several times per connection
    # (leastConnections counts, back-offs), and the generated one hashes all eight compared
    # fields through ipaddress's __hash__ (~0.3 us each time). Over the address as an integer
    # and the port, which equal endpoints share (so it agrees with ==) and which hash the same
    # in every process (no per-process string hash seed in a cached value).
    _hash: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", str(self.ip))

    def __hash__(self) -> int:
        h = self._hash
        if not h:
            h = hash((int(self.ip), self.port))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def address(self) -> tuple[IPAddress, int]:
        return (self.ip, self.port)

    def __str__(self) -> str:  # from `host`: the datapaths sort endpoints by this text (kube-proxy's order)
        return format_hostport(self.host, self.port)

    def sort_key(self) -> tuple[int, int, int]:
        """Order by family, address, port: IPv4 and IPv6 endpoints sort together safely."""
        return (self.ip.version, int(self.ip), self.port)

    def __lt__(self, other: Endpoint) -> bool:
        return self.sort_key() < other.sort_key()


def usable(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """Ready endpoints, or if there are none, the serving and terminating ones."""
    eps = tuple(endpoints)
    ready = tuple(ep for ep in eps if ep.ready)
    if len(ready) == len(eps) and eps:
        return eps
    if ready:
        return ready
    return tuple(ep for ep in eps if ep.serving and ep.terminating)


def merged(groups: Iterable[Iterable[Endpoint]]) -> tuple[Endpoint, ...]:
    """Endpoints of one ServicePort from one or more EndpointSlices: one per address and port,
    the ready one when an address appears twice (as kube-proxy endpointslicecache.go), sorted by
    Endpoint.sort_key so equal sets compare equal."""
    by_addr: dict[tuple[IPAddress, int], Endpoint] = {}
    for eps in groups:
        for ep in eps:
            seen = by_addr.get(ep.address)
            if seen is None or (ep.ready and not seen.ready):
                by_addr[ep.address] = ep
    return tuple(sorted(by_addr.values(), key=Endpoint.sort_key))


def _topology_filtered(
    eps: tuple[Endpoint, ...], sp: ServicePort, zone: str | None
) -> tuple[Endpoint, ...]:
    """Zone hints as kube-proxy: only when every endpoint has hints and some match our zone."""
    if sp.traffic_distribution != "PreferClose" or zone is None or not eps:
        return eps
    if any(not ep.zone_hints for ep in eps):
        return eps
    same = tuple(ep for ep in eps if zone in ep.zone_hints)
    return same or eps


@dataclass(frozen=True, slots=True)
class CategorizedEndpoints:
    """Endpoints for traffic from inside the cluster (ClusterIP) and from outside (NodePort,
    externalIPs, LoadBalancer IPs), after traffic policies and topology."""

    cluster: tuple[Endpoint, ...]
    external: tuple[Endpoint, ...]
    # the Cluster policy's endpoints whatever the policies say (kube-proxy's clusterEndpoints):
    # where pod and node traffic to an externalTrafficPolicy Local Service's external addresses goes
    cluster_policy: tuple[Endpoint, ...] = ()


def categorize(
    sp: ServicePort, endpoints: Sequence[Endpoint], node_name: str | None, zone: str | None = None
) -> CategorizedEndpoints:
    """Apply internalTrafficPolicy, externalTrafficPolicy and topology to a ServicePort's endpoints.

    As kube-proxy pkg/proxy/topology.go: "Local" policies use only this node's usable endpoints
    (by nodeName); "Cluster" uses every usable endpoint, narrowed by zone hints when the Service
    asks for trafficDistribution PreferClose and the hints allow it.
    """
    all_usable = usable(endpoints)
    wants_local = "Local" in (sp.internal_traffic_policy, sp.external_traffic_policy)
    local = usable(ep for ep in endpoints if ep.node_name == node_name) if wants_local and node_name is not None else ()
    cluster_wide = _topology_filtered(all_usable, sp, zone)
    cluster = local if sp.internal_traffic_policy == "Local" else cluster_wide
    external = local if sp.external_traffic_policy == "Local" else cluster_wide
    return CategorizedEndpoints(cluster=cluster, external=external, cluster_policy=cluster_wide)
