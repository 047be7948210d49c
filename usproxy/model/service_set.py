"""ServiceSet: the parsed Services and endpoints every renderer reads, split per IP family.

kube-proxy runs one proxier per IP family; `FamilyPort` is one ServicePort as the proxier of one
family sees it: that family's ClusterIP, externalIPs and LoadBalancer IPs, and that family's
endpoints in kube-proxy's order (sorted by "ip:port" text, as pkg/proxy/endpointslicecache.go
sorts them). Endpoint categories follow kube-proxy pkg/proxy/topology.go CategorizeEndpoints,
computed with `usproxy.model.endpoint.categorize`. Invariant: values only, nothing here does I/O except
`load_service_set`, which reads manifest files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from usproxy.model.types import IPNetwork
from usproxy.model.endpoint import Endpoint, categorize, usable
from usproxy.model.local_detector import LocalDetector
from usproxy.util.errors import ConfigError
from usproxy.model.manifest import Manifests, load_file, manifest_files
from usproxy.model.service_port import ServicePort
from usproxy.model.source_ranges import family_ranges
from usproxy.model.types import FAMILIES, Family, IPAddress, ServicePortName



@dataclass(frozen=True, slots=True)
class Node:
    """The node the rendering is for: what kube-proxy learns from flags and the Node object.

    `name` decides which endpoints are local (EndpointSlice nodeName); `ips` are the node
    addresses (NodePort addresses, kube-proxy's --nodeport-addresses=primary; also the node IP a
    loadBalancerSourceRanges entry may hold, kube-proxy's allowFromNode); `cluster_cidrs`
    enable the local-traffic detector (kube-proxy --cluster-cidr, detect-local-mode ClusterCIDR);
    `service_cidrs` enable nftables' "drop traffic to unallocated ClusterIPs" rule.

    Facts only the iptables rules read (the iptables datapath sets them from NodeFacts; explain
    leaves them at their defaults): `nodeport_ips`, when not None, are the NodePort addresses
    instead of `ips`, and `nodeport_match_all` makes every local address one (kube-proxy's
    MatchAll) whatever `ips` holds; `detector` replaces the ClusterCIDR detector of
    `cluster_cidrs` (NodeCIDR, BridgeInterface, InterfaceNamePrefix); `masquerade_all` marks all
    ClusterIP traffic for masquerade.
    """

    name: str | None = None
    ips: tuple[IPAddress, ...] = ()
    cluster_cidrs: tuple[IPNetwork, ...] = ()
    service_cidrs: tuple[IPNetwork, ...] = ()
    masquerade_mark: str = "0x4000"
    nodeport_ips: tuple[IPAddress, ...] | None = None
    nodeport_match_all: bool = False
    detector: LocalDetector | None = None
    masquerade_all: bool = False

    def ips_of(self, family: Family) -> tuple[IPAddress, ...]:
        return tuple(ip for ip in self.ips if ip.version == family)

    def nodeport_ips_of(self, family: Family) -> tuple[IPAddress, ...] | None:
        """The NodePort addresses of `family`; None: every local address (no `ips` of the
        family, or nodeport_match_all). Given `nodeport_ips` without one of `family`, none."""
        if self.nodeport_match_all:
            return None
        ips = self.ips if self.nodeport_ips is None else self.nodeport_ips
        mine = tuple(ip for ip in ips if ip.version == family)
        return mine if mine or self.nodeport_ips is not None else None

    def local_match(self, family: Family) -> tuple[str, str] | None:
        """How iptables tells pod traffic in `family`: ("-s", CIDR) or ("-i", interface, with
        "+" for a name prefix), as kube-proxy's LocalTrafficDetector; None when nothing is
        detected there (its no-op detector)."""
        det = self.detector
        if det is None:
            cidr = self.cluster_cidr(family)
            return ("-s", str(cidr)) if cidr is not None else None
        if det.mode == "BridgeInterface":
            return ("-i", det.interface)
        if det.mode == "InterfaceNamePrefix":
            return ("-i", det.interface + "+")
        return next((("-s", str(n)) for n in det.cidrs if n.version == family), None)

    def cluster_cidr(self, family: Family) -> IPNetwork | None:
        return next((c for c in self.cluster_cidrs if c.version == family), None)

    def service_cidrs_of(self, family: Family) -> tuple[IPNetwork, ...]:
        return tuple(c for c in self.service_cidrs if c.version == family)


@dataclass(frozen=True, slots=True)
class FamilyPort:
    """One ServicePort as one family's proxier sees it, with its endpoints categorized.

    `cluster` are the endpoints for "Cluster" policy, `local` for "Local" policy (this node's),
    `reachable` the union of the two that are in use; `has_endpoints` is true when the Service has
    a usable endpoint anywhere (kube-proxy's hasAnyEndpoints). `source_ranges` are this family's
    loadBalancerSourceRanges (empty: LB IPs take any source; usproxy.model.source_ranges.family_ranges).
    """

    sp: ServicePort
    family: Family
    cluster_ip: IPAddress
    external_ips: tuple[IPAddress, ...]
    lb_ips: tuple[IPAddress, ...]
    endpoints: tuple[Endpoint, ...]
    cluster: tuple[Endpoint, ...]
    local: tuple[Endpoint, ...]
    has_endpoints: bool
    source_ranges: tuple[IPNetwork, ...] = ()

    @property
    def name(self) -> ServicePortName:
        return self.sp.name

    @property
    def proto(self) -> str:
        """Lower-case protocol, as kube-proxy writes it in rules."""
        return self.sp.protocol.lower()

    @property
    def externally_accessible(self) -> bool:
        """NodePort, externalIPs or LoadBalancer IPs (kube-proxy ServicePort.ExternallyAccessible)."""
        return bool(self.sp.node_port or self.external_ips or self.lb_ips)

    @property
    def external_policy_local(self) -> bool:
        return self.externally_accessible and self.sp.external_traffic_policy == "Local"

    @property
    def internal_policy_local(self) -> bool:
        return self.sp.internal_traffic_policy == "Local"

    @property
    def uses_cluster_endpoints(self) -> bool:
        """kube-proxy ServicePort.UsesClusterEndpoints: Cluster internal policy, or any external
        access at all (an externalTrafficPolicy Local Service short-circuits pod and node traffic
        to the Cluster policy's endpoints, so its cluster chain is needed then too)."""
        return not self.internal_policy_local or self.externally_accessible

    @property
    def firewalled(self) -> bool:
        """LoadBalancer IPs filtered by source (kube-proxy nftables' usesFWChain; iptables also
        needs endpoints, see iptables.plan)."""
        return bool(self.source_ranges and self.lb_ips)

    def firewall_sources(self, node: Node) -> tuple[str, ...]:
        """The sources a firewalled LB IP accepts, as kube-proxy writes them: each range, then
        each LB IP when a range holds one of the node's addresses (a node reaching a VIP-style LB
        IP is looped back with the LB IP as its source). The same set as
        usproxy.model.source_ranges.allowed_sources, which the datapaths enforce."""
        lb_ips = self.lb_ips if self.allows_from_node(node) else ()
        return (*map(str, self.source_ranges), *map(str, lb_ips))

    def allows_from_node(self, node: Node) -> bool:
        """A range holds one of the node's addresses, so the LB IPs are allowed as sources too
        (kube-proxy's allowFromNode)."""
        return any(ip in r for r in self.source_ranges for ip in node.ips_of(self.family))

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or self.external_policy_local

    @property
    def internal(self) -> tuple[Endpoint, ...]:
        """Endpoints ClusterIP traffic goes to."""
        return self.local if self.internal_policy_local else self.cluster

    @property
    def external(self) -> tuple[Endpoint, ...]:
        """Endpoints NodePort / externalIP / LoadBalancer traffic goes to."""
        return self.local if self.external_policy_local else self.cluster

    @property
    def reachable(self) -> tuple[Endpoint, ...]:
        """Every endpoint some rule of this ServicePort may reach, in kube-proxy order."""
        cluster = self.cluster if self.uses_cluster_endpoints else ()
        local = self.local if self.uses_local_endpoints else ()
        seen = {str(ep): ep for ep in (*cluster, *local)}
        return tuple(sorted(seen.values(), key=str))


@dataclass(frozen=True, slots=True)
class ServiceSet:
    """Every ServicePort with all its endpoints (every family), sorted by ServicePortName."""

    ports: tuple[tuple[ServicePort, tuple[Endpoint, ...]], ...]
    node: Node = Node()
    skipped: tuple[str, ...] = ()

    def families(self) -> tuple[Family, ...]:
        """The IP families some ServicePort has a ClusterIP of, IPv4 first."""
        present = {ip.version for sp, _ in self.ports for ip in sp.cluster_ips}
        return tuple(f for f in FAMILIES if f in present)

    def family_ports(self, family: Family) -> tuple[FamilyPort, ...]:
        out = []
        for sp, eps in self.ports:
            fp = family_port(sp, eps, family, self.node.name)
            if fp is not None:
                out.append(fp)
        return tuple(out)


def _of(family: Family, ips: Iterable[IPAddress]) -> tuple[IPAddress, ...]:
    return tuple(ip for ip in ips if ip.version == family)


def family_port(sp: ServicePort, endpoints: Sequence[Endpoint], family: Family,
                node_name: str | None) -> FamilyPort | None:
    """The ServicePort as the `family` proxier sees it, or None if it has no ClusterIP there."""
    cluster_ips = _of(family, sp.cluster_ips)
    if not cluster_ips:
        return None
    eps = tuple(sorted((ep for ep in endpoints if ep.ip.version == family), key=str))
    # categorize() applies each policy; asking for both lets one call yield both lists.
    both = categorize(replace(sp, internal_traffic_policy="Cluster", external_traffic_policy="Local"),
                      eps, node_name)
    return FamilyPort(
        sp=sp, family=family, cluster_ip=cluster_ips[0],
        external_ips=_of(family, sp.external_ips), lb_ips=_of(family, sp.load_balancer_ips),
        endpoints=eps, cluster=both.cluster, local=both.external,
        has_endpoints=bool(usable(eps)), source_ranges=family_ranges(sp.source_ranges, family),
    )


def merge_endpoints(m: Manifests) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    """Endpoints per ServicePortName over every slice; one address:port counts once, ready wins.

    As kube-proxy pkg/proxy/endpointslicecache.go: slices of one Service are merged, duplicates
    (during a slice rewrite) are kept once, preferring the ready one.
    """
    merged: dict[ServicePortName, dict[str, Endpoint]] = {}
    for es in sorted(m.slices.values(), key=lambda s: (s.name.namespace, s.name.name)):
        for spn, eps in es.endpoints.items():
            by_addr = merged.setdefault(spn, {})
            for ep in eps:
                seen = by_addr.get(str(ep))
                if seen is None or (ep.ready and not seen.ready):
                    by_addr[str(ep)] = ep
    return {spn: tuple(sorted(eps.values(), key=str)) for spn, eps in merged.items()}


def service_set(m: Manifests, node: Node = Node()) -> ServiceSet:
    """A ServiceSet from parsed manifests. Raises the first ConfigError of `m.errors`."""
    if m.errors:
        raise m.errors[0]
    eps = merge_endpoints(m)
    ports = sorted((sp for svc in m.services.values() for sp in svc.ports.values()),
                   key=lambda sp: sp.name)
    return ServiceSet(tuple((sp, eps.get(sp.name, ())) for sp in ports), node, tuple(m.skipped))


def require_path(path: Path) -> None:
    """ConfigError naming `path` when it does not exist (checked before an agent starts, too)."""
    if not path.exists():
        raise ConfigError("no such file or directory", obj=str(path))


def load_manifests(path: Path) -> Manifests:
    """Every manifest under `path` (a file or a directory). Raises ConfigError."""
    files = manifest_files(path)
    require_path(path)
    if not files:
        raise ConfigError("no manifest files (*.yaml, *.yml, *.json)", obj=str(path))
    out = Manifests()
    for f in files:
        out.merge(load_file(f))
    return out
