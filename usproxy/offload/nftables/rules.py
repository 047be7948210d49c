"""What one ServicePort holds in one family's table, computed from the model (no I/O).

`port_rules()` turns a ServicePortState into PortRules: the frontends (ClusterIPs, external and
LoadBalancer IPs, the NodePort) and per traffic scope the endpoints in slot order. Slot order is
stable across changes (`assign_slots`), so an endpoint change touches only the changed slots.
Values are NamedTuples of text: a cold sync of 10,000 Services builds ~100,000 of them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection, Iterable, Sequence
from typing import Literal, NamedTuple

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint, usable
from usproxy.offload.nftables.names import (
    Kind,
    affinity_chain,
    group_chain,
    rr_chain,
    short_circuit_chain,
)
from usproxy.model.service_port import ServicePort
from usproxy.model.source_ranges import allowed_sources
from usproxy.model.types import Family, IPAddress, Scope, ServicePortName, format_hostport

_TEXT: dict[int, str] = {}
# Builds a NamedTuple from a tuple of every field without NamedTuple's Python-level __new__: a
# cold sync of 10,000 Services makes ~100,000 Targets, Frontends, Backends and Elems.
new_tuple = tuple.__new__


def ip_text(ip: IPAddress) -> str:
    """str(ip), cached by the address's integer: ipaddress formats (and hashes) in Python, which
    dominated a cold sync of 10,000 Services. IPv6 keys are negative so families never collide."""
    num = int(ip)
    v4 = isinstance(ip, ipaddress.IPv4Address)
    key = num if v4 else -1 - num
    text = _TEXT.get(key)
    if text is None:
        if len(_TEXT) > 1 << 18:
            _TEXT.clear()
        text = _TEXT[key] = socket.inet_ntoa(num.to_bytes(4, "big")) if v4 else str(ip)
    return text


def norm_ip(text: str) -> str:
    """An address in the form str(ipaddress) gives (as nft prints it): the layout's keys."""
    return str(ipaddress.ip_address(text))


# -- values --------------------------------------------------------------------------------------
class Target(NamedTuple):
    """One endpoint address as the kernel sees it (conditions are the manager's business).
    Addresses are text here: the layout only renders them, and a cold sync of 10,000 Services
    would otherwise spend most of its time hashing and formatting ipaddress objects. Target,
    Frontend and Backend are NamedTuples (immutable values, built in C): a cold sync makes
    tens of thousands of them, and frozen dataclasses took a third of its time."""

    ip: str
    port: int

    def nft(self) -> str:
        return f"{self.ip} . {self.port}"

    def hostport(self) -> str:
        return format_hostport(self.ip, self.port)


class Frontend(NamedTuple):
    """Where a ServicePort is reached: an address . proto . port, or a NodePort (addr None)."""

    addr: str | None
    proto: str
    port: int
    scope: Scope

    @property
    def kind(self) -> Kind:
        return "np" if self.addr is None else "ip"

    def key(self) -> str:
        if self.addr is None:
            return f"{self.proto} . {self.port}"
        return f"{self.addr} . {self.proto} . {self.port}"


class Backend(NamedTuple):
    """How one scope (cluster or external traffic) picks endpoints: targets in slot order."""

    targets: tuple[Target, ...] = ()
    masq: bool = False
    affinity: int = 0  # ClientIP timeout in seconds; 0: no affinity
    round_robin: bool = False  # lb-policy roundRobin: `numgen inc` in chains of its own
    # with masq: mark only what the local-traffic detector says is not from a pod (kube-proxy's
    # ClusterIP rule with a detector); the match is the table's (TableState.not_local)
    nonlocal_only: bool = False
    # no targets here but endpoints elsewhere (a Local policy without local endpoints): the
    # frontend drops instead of rejecting, as kube-proxy
    drop: bool = False
    # externalTrafficPolicy Local: every endpoint of the Cluster policy, sorted, where pod and
    # node traffic to the external frontends goes (kube-proxy's short-circuit); `targets` stay
    # the local endpoints that other external traffic goes to
    short: tuple[Target, ...] = ()

    def serves(self) -> bool:
        """Whether its frontends are in the service maps (else in the no-endpoint maps)."""
        return bool(self.targets or self.short)


_EMPTY = Backend()


class PortRules(NamedTuple):
    """Everything one ServicePort holds in one family's table (a NamedTuple, as Target)."""

    spn: ServicePortName
    family: Family
    frontends: tuple[Frontend, ...]
    cluster: Backend
    external: Backend
    # endpoint addresses that may be clients of this ServicePort through this node (port_rules);
    # kept beside the targets, not in them, so a read back that can only guess it per address
    # never makes slot elements look changed
    hairpin: frozenset[str] = frozenset()
    # loadBalancerSourceRanges: the allowed sources as nft writes them (collapsed, sorted), and the
    # keys of the LoadBalancer frontends they guard; both empty when nothing is filtered
    fw_sources: tuple[str, ...] = ()
    fw_keys: tuple[str, ...] = ()

    def backend(self, scope: Scope) -> Backend:
        return self.cluster if scope == "cluster" else self.external

    def targets(self) -> set[Target]:
        return {*self.cluster.targets, *self.external.targets, *self.external.short}

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints the kernel serves (cluster, external and short-circuit), for read back."""
        return tuple(sorted(Endpoint(ipaddress.ip_address(t.ip), t.port) for t in self.targets()))


def verdict_of(rules: PortRules, fe: Frontend) -> str:
    """The chain a frontend's verdict element jumps to (`goto <chain>`), or `drop`."""
    if rules.backend(fe.scope).short:
        return short_circuit_chain(rules.spn, fe.kind)
    return local_verdict(rules, fe)


def local_verdict(rules: PortRules, fe: Frontend) -> str:
    """verdict_of without the short-circuit: what traffic that is not short-circuited gets."""
    be = rules.backend(fe.scope)
    if not be.targets:
        return "drop" if be.drop else "reject-chain"
    if be.affinity:
        return affinity_chain(rules.spn, fe.scope)
    if be.round_robin:
        return rr_chain(rules.spn, fe.scope, fe.kind)
    return group_chain(fe.kind, len(be.targets), be.masq, be.nonlocal_only)


def verdict_text(rules: PortRules, fe: Frontend) -> str:
    """A frontend's verdict element value: `goto <chain>`, or `drop`."""
    v = verdict_of(rules, fe)
    return v if v == "drop" else "goto " + v


# -- from the model --------------------------------------------------------------------------------
def assign_slots(previous: Sequence[Target], wanted: Iterable[Target]) -> tuple[Target, ...]:
    """Slot order for `wanted` that moves as few targets as possible from `previous`.

    Remaining targets keep their slots; a freed slot takes a new target, or else the last target
    (so slots stay dense 0..N-1); new targets left over are appended in sorted order.
    """
    if not previous:
        return tuple(sorted(wanted))
    want = set(wanted)
    fresh = sorted(want - set(previous), reverse=True)
    slots: list[Target | None] = [t if t in want else (fresh.pop() if fresh else None) for t in previous]
    while None in slots:
        last = slots.pop()
        if last is not None:
            slots[slots.index(None)] = last
    return (*(t for t in slots if t is not None), *reversed(fresh))


def _targets(eps: Iterable[Endpoint], v4: bool, node: str | None, hairpin: set[str]) -> list[Target]:
    """Targets of `eps` in one family; adds to `hairpin` the addresses that may be on this node."""
    out = []
    for ep in eps:
        if isinstance(ep.ip, ipaddress.IPv4Address) is v4:
            out.append(t := new_tuple(Target, (ip_text(ep.ip), ep.port)))
            if node is None or ep.node_name is None or ep.node_name == node:
                hairpin.add(t.ip)
    return out


def _slots(previous: Sequence[Target], wanted: list[Target]) -> tuple[Target, ...]:
    if not previous:
        return tuple(sorted(set(wanted))) if len(wanted) > 1 else tuple(wanted)
    return assign_slots(previous, wanted)


_PROTO = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}


ClusterMasq = Literal["none", "all", "nonlocal"]


def port_rules(state: ServicePortState, family: Family, previous: PortRules | None,
               node_name: str | None = None, cluster_masq: ClusterMasq = "none",
               node_ips: Collection[IPAddress] = ()) -> PortRules | None:
    """What `state` needs in `family`'s table, keeping `previous` slot positions. None: nothing
    (the ServicePort has no ClusterIP in this family).

    `node_name` is this node's: endpoints on other nodes (EndpointSlice nodeName set and not
    ours) get no hairpin element. Their own traffic to the Service is DNATed on their own node, and
    what reaches this node from them as external traffic is masqueraded anyway (as Cilium, which
    handles hairpin for local endpoints only; kube-proxy marks every endpoint). Endpoints without a
    nodeName, or every endpoint when the agent has no node name, may be local and get one.

    `cluster_masq` is what ClusterIP traffic has marked for masquerade, as kube-proxy's nftables
    mode: "all" with masqueradeAll, "nonlocal" with a local-traffic detector for this family (what
    does not come from a pod), "none" without either. A scope without targets while the
    ServicePort has endpoints elsewhere (a Local policy, no local endpoint) drops (kube-proxy).
    externalTrafficPolicy Local external frontends short-circuit pod and node traffic to every
    endpoint (`state.short_circuit_endpoints`, Backend.short).

    `node_ips` are this node's addresses: a source range holding one also allows the LB IPs as
    sources (usproxy.model.source_ranges.allowed_sources)."""
    sp = state.service_port
    v4 = family == 4
    cluster_ips = [ip for ip in sp.cluster_ips if isinstance(ip, ipaddress.IPv4Address) is v4]
    if not cluster_ips:
        return None
    proto, port = _PROTO[sp.name.protocol], sp.port
    fes = [new_tuple(Frontend, (ip_text(ip), proto, port, "cluster")) for ip in cluster_ips]
    if sp.external_ips or sp.load_balancer_ips:
        fes += [Frontend(ip_text(ip), proto, port, "external") for ip in sp.external_ips_all()
                if isinstance(ip, ipaddress.IPv4Address) is v4]
    if sp.node_port:
        fes.append(Frontend(None, proto, sp.node_port, "external"))
    affinity = sp.affinity_timeout if sp.session_affinity == "ClientIP" else 0
    rr = sp.lb_policy == "roundRobin"
    hairpin: set[str] = set()
    c_targets = _slots(previous.cluster.targets if previous else (), _targets(state.cluster_endpoints, v4, node_name, hairpin))
    cluster = new_tuple(Backend, (c_targets, cluster_masq != "none", affinity, rr, cluster_masq == "nonlocal",
                                  not c_targets and _has_usable(state, v4), ()))
    external = _EMPTY
    if len(fes) > len(cluster_ips):  # externalIPs, LoadBalancer IPs or a NodePort
        masq = sp.external_traffic_policy == "Cluster"
        e_targets = _slots(previous.external.targets if previous else (), _targets(state.external_endpoints, v4, node_name, hairpin))
        short = tuple(sorted(set(_targets(state.short_circuit_endpoints, v4, node_name, hairpin))))
        external = Backend(e_targets, masq, affinity, rr, False, not e_targets and _has_usable(state, v4), short)
    if len(fes) > 1:
        fes.sort(key=frontend_order)
    fw_sources, fw_keys = _firewall(sp, family, proto, node_ips)
    return new_tuple(PortRules, (sp.name, family, tuple(fes), cluster, external, frozenset(hairpin),
                                 fw_sources, fw_keys))


def _firewall(sp: ServicePort, family: Family, proto: str,
              node_ips: Collection[IPAddress]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(allowed sources, guarded LB frontend keys) of one family, as kube-proxy's firewall chain
    (pkg/proxy/nftables/proxier.go: usesFWChain when the Service has LB IPs and ranges)."""
    if not sp.source_ranges or not sp.load_balancer_ips:
        return (), ()
    lb_ips = [ip for ip in sp.load_balancer_ips if ip.version == family]
    sources = allowed_sources(sp.source_ranges, family, lb_ips, node_ips)
    if not sources or not lb_ips:
        return (), ()
    keys = tuple(sorted(f"{ip_text(ip)} . {proto} . {sp.port}" for ip in lb_ips))
    # one family only (allowed_sources), so collapse_addresses cannot mix versions
    return tuple(source_text(n) for n in ipaddress.collapse_addresses(sources)), keys  # type: ignore[type-var]


def source_text(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    """A source range as nft lists it: a host route as its bare address, else address/length.
    Ranges are collapsed first: an anonymous interval set refuses overlapping elements."""
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


def _has_usable(state: ServicePortState, v4: bool) -> bool:
    """Whether the ServicePort has a usable endpoint anywhere in this family (kube-proxy's
    hasEndpoints, per family proxier): without one a frontend rejects, with one it drops."""
    return bool(usable(ep for ep in state.endpoints if isinstance(ep.ip, ipaddress.IPv4Address) is v4))


def frontend_order(fe: Frontend) -> tuple[int, str, int]:
    """PortRules.frontends order: addresses first (by text, then port), then NodePorts."""
    return (0 if fe.addr is not None else 1, fe.addr or "", fe.port)
