"""Generated ServiceSets: N Services shaped like an input's, and one endpoint added to one of them.

`generate(ss, n)` copies the input's Services in turn (their ports, endpoints per port with their
conditions and nodes, policies, affinity, NodePort/externalIP/LoadBalancer shape) into N Services
named scale/svc-1 .. scale/svc-N (zero-padded, so generation order is the sorted order every
renderer uses and the last one generated sorts last). Addresses are new and unique: ClusterIPs
from 10.96.0.0/16 (fd00:10:96::/112), pod addresses from 10.244.0.0/16 (fd00:10:244::/64),
externalIPs and LoadBalancer IPs from 198.18.0.0/15 (2001:db8:18::/64), NodePorts and health
check NodePorts counted up from 30000 (beyond kube's default 30000-32767 once more than 2,768 are
needed, as a wider --service-node-port-range allows). Running out of a pool raises ConfigError.
Invariant: values in, values out; no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import ConfigError
from usproxy.model.service_set import ServiceSet
from usproxy.model.service_port import ServicePort
from usproxy.model.types import IPAddress, IPNetwork, ServicePortName

NAMESPACE = "scale"
POOLS: dict[tuple[str, int], IPNetwork] = {
    ("cluster", 4): ipaddress.ip_network("10.96.0.0/16"),
    ("cluster", 6): ipaddress.ip_network("fd00:10:96::/112"),
    ("pod", 4): ipaddress.ip_network("10.244.0.0/16"),
    ("pod", 6): ipaddress.ip_network("fd00:10:244::/64"),
    ("external", 4): ipaddress.ip_network("198.18.0.0/15"),
    ("external", 6): ipaddress.ip_network("2001:db8:18::/64"),
}
FIRST_NODE_PORT = 30000

Template = list[tuple[ServicePort, tuple[Endpoint, ...]]]  # one Service: its ports in order


@dataclass
class _Allocator:
    """Hands out the next unused address of each pool, and NodePorts."""

    used: dict[tuple[str, int], int] = field(default_factory=dict)
    node_port: int = FIRST_NODE_PORT

    def ip(self, kind: str, family: int) -> IPAddress:
        pool = POOLS[(kind, family)]
        n = self.used.get((kind, family), 0) + 1  # skip the network address
        if n >= pool.num_addresses - 1:
            raise ConfigError(f"more than {pool.num_addresses - 2} {kind} addresses needed",
                              obj="usproxy explain", field="--scale")
        self.used[(kind, family)] = n
        return pool[n]

    def port(self) -> int:
        if self.node_port > 65535:
            raise ConfigError(f"more than {65536 - FIRST_NODE_PORT} NodePorts needed",
                              obj="usproxy explain", field="--scale")
        self.node_port += 1
        return self.node_port - 1


def templates(ss: ServiceSet) -> list[Template]:
    """The input's Services, each as its ServicePorts with their endpoints, in sorted order."""
    out: dict[tuple[str, str], Template] = {}
    for sp, eps in ss.ports:
        out.setdefault(sp.name.service, []).append((sp, eps))
    return list(out.values())


def generate(ss: ServiceSet, n: int) -> ServiceSet:
    """N Services shaped like `ss`'s (see the module docstring), for the same node.
    Raises ConfigError when `ss` has no Service or a pool runs out."""
    shapes = templates(ss)
    if not shapes:
        raise ConfigError("the input has no Service to generate from", obj="usproxy explain", field="--scale")
    alloc, width, ports = _Allocator(), len(str(n)), []
    for i in range(n):
        ports += _copy(shapes[i % len(shapes)], f"svc-{i + 1:0{width}d}", alloc)
    return ServiceSet(tuple(sorted(ports, key=lambda p: p[0].name)), ss.node)


def _copy(shape: Template, name: str, alloc: _Allocator) -> Template:
    """One Service of `shape` under a new name, with new addresses (one per old address, so
    addresses shared between its ports stay shared) and new NodePorts."""
    new_ip: dict[tuple[str, IPAddress], IPAddress] = {}

    def ip(kind: str, old: IPAddress) -> IPAddress:
        if (kind, old) not in new_ip:
            new_ip[(kind, old)] = alloc.ip(kind, old.version)
        return new_ip[(kind, old)]

    out = []
    for sp, eps in shape:
        copy = replace(
            sp, name=ServicePortName(NAMESPACE, name, sp.name.port, sp.name.protocol),
            cluster_ips=tuple(ip("cluster", a) for a in sp.cluster_ips),
            external_ips=tuple(ip("external", a) for a in sp.external_ips),
            load_balancer_ips=tuple(ip("external", a) for a in sp.load_balancer_ips),
            node_port=alloc.port() if sp.node_port else 0,
            health_check_node_port=alloc.port() if sp.health_check_node_port else 0, labels=())
        out.append((copy, tuple(sorted((replace(ep, ip=ip("pod", ep.ip)) for ep in eps), key=str))))
    return out


def _endpoint_ips(ss: ServiceSet, family: int) -> Iterator[IPAddress]:
    return (ep.ip for _, eps in ss.ports for ep in eps if ep.ip.version == family)


def with_endpoint_added(ss: ServiceSet, name: ServicePortName) -> ServiceSet:
    """`ss` with one ready endpoint added to ServicePort `name`: in its primary ClusterIP's
    family, at the address after the highest endpoint address of that family (or the pod pool's
    first), on the port and node of its first endpoint (else its numeric targetPort, else its
    port, on no node). Raises KeyError for a ServicePort `ss` does not hold."""
    sp, eps = next((sp, eps) for sp, eps in ss.ports if sp.name == name)
    family = sp.cluster_ip.version
    like = next((ep for ep in eps if ep.ip.version == family), None)
    top = max(_endpoint_ips(ss, family), default=POOLS[("pod", family)][0])
    port = like.port if like else (sp.target_port if isinstance(sp.target_port, int) else sp.port)
    added = Endpoint(top + 1, port, node_name=like.node_name if like else None)
    ports = tuple((p, tuple(sorted((*e, added), key=str))) if p.name == name else (p, e) for p, e in ss.ports)
    return replace(ss, ports=ports)
