"""FrontendClaims: which ServicePort serves each frontend, when Services ask for the same one.

A frontend is an address, port and protocol (a ClusterIP, externalIP or LoadBalancer IP with the
ServicePort's port), or a NodePort (no address: every node address). Nothing in a Service's spec
stops two Services from naming the same frontend: an externalIP may equal another Service's
ClusterIP (CVE-2020-8554, "man in the middle using ExternalIPs"), two Services may list the same
externalIP and port, and a static manifest may repeat a ClusterIP or a nodePort. Every datapath
can hold only one owner per frontend (the relay one listener, nftables one map element, BPF one
service entry), so the owner is decided here, once, for all of them:

- a ClusterIP claim beats an externalIP/LoadBalancer-IP claim (ClusterIPs are allocated by the
  API server; an externalIP naming one is the CVE's attack), whichever came first;
- otherwise the ServicePort that holds a frontend keeps it (what works is not taken away by a
  newcomer); claims made in the same sync are settled in ServicePortName order;
- when the owner lets go (Service changed or deleted), the best waiting claim takes over.

The loser is served without that frontend; a ServicePort that loses a ClusterIP:port is not
served at all and holds none of its other frontends until it gets its ClusterIPs back (the
ClusterIP:ports it does hold stay reserved to it: an externalIP naming them still loses).
Settling is independent of the order changes arrive in within a sync. The
conflict is logged with both Services and the field.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from usproxy.model.service_port import ServicePort
from usproxy.model.types import IPAddress, Protocol, ServicePortName, format_hostport

log = logging.getLogger(__name__)

FrontendKey = tuple[IPAddress | None, int, Protocol]  # address None: a NodePort

CLUSTER_IP, NODE_PORT, EXTERNAL = 0, 1, 2  # claim ranks: lower wins
_FIELD = {CLUSTER_IP: "spec.clusterIPs", NODE_PORT: "spec.ports[].nodePort", EXTERNAL: "spec.externalIPs/loadBalancer"}


def frontend_claims(sp: ServicePort) -> dict[FrontendKey, int]:
    """Every frontend `sp` asks for, with its rank."""
    proto = sp.name.protocol
    if not (sp.external_ips or sp.load_balancer_ips or sp.node_port or len(sp.cluster_ips) > 1):
        return {(sp.cluster_ips[0], sp.port, proto): CLUSTER_IP}  # the common case, fast
    out: dict[FrontendKey, int] = {}
    for ip in sp.external_ips_all():
        out[(ip, sp.port, proto)] = EXTERNAL
    if sp.node_port:
        out[(None, sp.node_port, proto)] = NODE_PORT
    for ip in sp.cluster_ips:
        out[(ip, sp.port, proto)] = CLUSTER_IP
    return out


def without_frontends(sp: ServicePort, lost: dict[FrontendKey, int]) -> ServicePort:
    """`sp` without the externalIPs, LoadBalancer IPs and NodePort another ServicePort serves."""
    gone = {k[0] for k, r in lost.items() if r == EXTERNAL}
    return dataclasses.replace(
        sp, external_ips=tuple(ip for ip in sp.external_ips if ip not in gone),
        load_balancer_ips=tuple(ip for ip in sp.load_balancer_ips if ip not in gone),
        node_port=0 if NODE_PORT in lost.values() else sp.node_port)


def describe(key: FrontendKey) -> str:
    ip, port, proto = key
    return f"NodePort {port}/{proto}" if ip is None else f"{format_hostport(ip, port)}/{proto}"


@dataclass
class FrontendClaims:
    """Owners of contested frontends; `update()` per changed ServicePort, `lost()` per state."""

    owner: dict[FrontendKey, tuple[ServicePortName, int]] = field(default_factory=dict)  # (owner, sync it got it in)
    wanted: dict[ServicePortName, dict[FrontendKey, int]] = field(default_factory=dict)
    waiting: dict[FrontendKey, set[ServicePortName]] = field(default_factory=dict)
    generation: int = 0  # syncs begun

    def begin(self) -> None:
        """A new sync: frontends taken from now on settle ties among themselves in name order."""
        self.generation += 1

    def owner_of(self, key: FrontendKey) -> ServicePortName | None:
        held = self.owner.get(key)
        return held[0] if held is not None else None

    def update(self, spn: ServicePortName, sp: ServicePort | None) -> set[ServicePortName]:
        """Re-claim `spn`'s frontends (None: it is gone). Returns the other ServicePorts whose
        served frontends changed, which must be synced again."""
        new = frontend_claims(sp) if sp is not None else {}
        old = self.wanted.get(spn, {})
        if not old:  # a new ServicePort (the whole of a cold sync)
            if sp is None:
                return set()
            self.wanted[spn] = new
            if len(new) == 1:
                ((k, _),) = new.items()
                if self.owner.setdefault(k, (spn, self.generation))[0] == spn:  # uncontested
                    return set()
            return self._claim(spn, new) - {spn}
        kept = {k for k, r in new.items() if self.owner_of(k) == spn and r <= old.get(k, r)}  # held: keep
        for k in old:  # stop waiting first, so the hand-overs below never pick `spn`
            if self.owner_of(k) != spn:
                self._unwait(k, spn)
        self.wanted[spn] = {**old, **new}  # every frontend it may hold keeps a rank meanwhile
        affected = self._release(spn, [k for k in old if k not in kept and self.owner_of(k) == spn])
        if sp is None:
            del self.wanted[spn]
        else:
            self.wanted[spn] = new
            affected |= self._claim(spn, {k: r for k, r in new.items() if self.owner_of(k) != spn})
            if self._dormant(spn):  # its new ClusterIP:port is another's: what it kept goes too
                affected |= self._release(spn, [k for k, r in new.items() if r != CLUSTER_IP and self.owner_of(k) == spn])
        affected.discard(spn)
        return affected

    def lost(self, spn: ServicePortName) -> dict[FrontendKey, int]:
        """Frontends `spn` asks for but another ServicePort serves, with their ranks."""
        if not self.waiting:  # every loser waits for its frontend: no waiter, no loss
            return {}
        return {k: r for k, r in self.wanted.get(spn, {}).items() if self.owner_of(k) != spn}

    def _release(self, spn: ServicePortName, keys: list[FrontendKey]) -> set[ServicePortName]:
        affected: set[ServicePortName] = set()
        for key in keys:
            if self.owner_of(key) != spn:
                self._unwait(key, spn)
                continue
            del self.owner[key]
            heir = self._best_waiter(key)
            if heir is not None:
                self._unwait(key, heir)
                self.owner[key] = (heir, self.generation)
                affected.add(heir)
                log.info("%s now serves %s (released by %s)", heir, describe(key), spn)
                if not self._dormant(heir):  # it has its ClusterIPs again: it claims the rest
                    affected |= self._claim(heir, self._unclaimed(heir))
        return affected

    def _dormant(self, spn: ServicePortName) -> bool:
        """Not served: another ServicePort has one of its ClusterIP:ports. A dormant ServicePort
        holds none of its other frontends and waits only for its ClusterIPs."""
        return any(r == CLUSTER_IP and self.owner_of(k) != spn for k, r in self.wanted[spn].items())

    def _unclaimed(self, spn: ServicePortName) -> dict[FrontendKey, int]:
        return {k: r for k, r in self.wanted[spn].items()
                if r != CLUSTER_IP and self.owner_of(k) != spn and spn not in self.waiting.get(k, ())}

    def _claim(self, spn: ServicePortName, claims: dict[FrontendKey, int]) -> set[ServicePortName]:
        """Claim ClusterIPs first; the rest only if all of them are held (else: dormant)."""
        affected = self._claim_keys(spn, {k: r for k, r in claims.items() if r == CLUSTER_IP})
        if not self._dormant(spn):
            affected |= self._claim_keys(spn, {k: r for k, r in claims.items() if r != CLUSTER_IP})
        return affected

    def _claim_keys(self, spn: ServicePortName, claims: dict[FrontendKey, int]) -> set[ServicePortName]:
        affected: set[ServicePortName] = set()
        for key, rank in claims.items():
            holder, since = self.owner.setdefault(key, (spn, self.generation))
            if holder == spn:
                continue
            held = self.wanted[holder][key]
            # a ClusterIP displaces an external claim; equal claims: the holder keeps it, unless
            # it got it in this same sync, where the smaller name wins (order-independent)
            if rank < held or (rank == held and since == self.generation and spn < holder):
                self.owner[key] = (spn, self.generation)
                self.waiting.setdefault(key, set()).add(holder)
                affected.add(holder)
                loser, winner, lost_rank = holder, spn, held
                if held == CLUSTER_IP:  # the holder goes dormant: its other frontends go too
                    others = [k for k, r in self.wanted[holder].items() if r != CLUSTER_IP]
                    affected |= self._release(holder, others)
            else:
                self.waiting.setdefault(key, set()).add(spn)
                loser, winner, lost_rank = spn, holder, rank
            log.error("Service %s/%s: %s %s is also claimed by %s; %s serves it, %s is served without it",
                      loser.namespace, loser.name, _FIELD[lost_rank], describe(key), winner, winner, loser)
        return affected

    def _best_waiter(self, key: FrontendKey) -> ServicePortName | None:
        waiters = self.waiting.get(key)
        if not waiters:
            return None
        return min(waiters, key=lambda s: (self.wanted[s][key], s))

    def _unwait(self, key: FrontendKey, spn: ServicePortName) -> None:
        waiters = self.waiting.get(key)
        if waiters is not None:
            waiters.discard(spn)
            if not waiters:
                del self.waiting[key]
