"""StaleUdp: which kernel conntrack entries of UDP Services are stale, as a pure function.

kube-proxy's rule (pkg/proxy/conntrack/cleanup.go CleanStaleEntries, run at every sync): list
the table once and delete each UDP entry whose original destination is a Service frontend
(ClusterIP, LoadBalancer IP or externalIP with the Service's port, or a NodePort) and whose
reply source is not a serving endpoint of that Service (EndpointSlice `serving`, whatever the
traffic policies or readiness say, so a change of policy moves no live flow). This catches what
a list of "endpoints removed in this sync" cannot: an endpoint removed while the agent was down
(a rollout, an OOM kill), whose sessions the new agent never saw end (issue 29 item 7).

Where usproxy differs, on the safe side:
- an entry whose reply source address is its original destination address was not DNATed by a
  Service rule: the relay's own flows (relayed, or captured to the relay's port on the same
  address) and whatever else the node does with that port. It is never stale here;
- endpoints are compared by address and port (kube-proxy: address only), so an endpoint whose
  port changed is stale too;
- a NodePort rule applies only to a destination address that is no frontend (a ClusterIP whose
  port happens to equal a NodePort keeps its own rule);
- the frontends of ServicePorts removed since the last pass (`gone`) count with no endpoint, so a
  deleted UDP Service's DNATed sessions end too (C21) instead of running on until idle.

`endpoints_gone` is the older, narrower rule (C03: the endpoints a sync removed): a DNATed entry
replying from one of them is stale wherever it was sent.

`StaleUdp` is the whole input, a value: built from ServicePortStates (`of`), sent to the
subprocess that lists the kernel's table as JSON (`to_json`/`from_json`), asked per entry
(`stale`). Addresses are kept packed (4 or 16 bytes), as netlink gives them. Any datapath that
DNATs UDP (nftables here, an iptables datapath later) reconciles through it.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from usproxy.model.service_port_state import ServicePortState

HostPort = tuple[bytes, int]  # (packed address, port)


def packed(ip: object) -> bytes:
    """An address (ipaddress object or text) packed, as netlink carries it."""
    text = str(ip)
    return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)


@dataclass(frozen=True, slots=True)
class StaleUdp:
    """Per UDP frontend (address, port) and per NodePort, the endpoints (address, port) its
    kernel entries may have as reply source."""

    frontends: Mapping[HostPort, frozenset[HostPort]] = field(default_factory=dict)
    node_ports: Mapping[int, frozenset[HostPort]] = field(default_factory=dict)
    addresses: frozenset[bytes] = frozenset()  # every frontend address: no NodePort rule there
    endpoints_gone: frozenset[HostPort] = frozenset()

    @classmethod
    def of(cls, states: Iterable[ServicePortState], gone: Iterable[ServicePortState] = ()) -> StaleUdp:
        """The rule for the UDP ServicePorts `states`, and for the frontends of `gone` (removed
        ServicePorts) that no current one still uses, with no endpoint."""
        fronts: dict[HostPort, set[HostPort]] = {}
        nodes: dict[int, set[HostPort]] = {}
        for st in states:
            if st.service_port.protocol == "UDP":
                _add(fronts, nodes, st, {(packed(ep.ip), ep.port) for ep in st.endpoints if ep.serving})
        for st in gone:  # adds no endpoint: a frontend still in use keeps its current ones
            if st.service_port.protocol == "UDP":
                _add(fronts, nodes, st, set())
        return cls({k: frozenset(v) for k, v in fronts.items()}, {k: frozenset(v) for k, v in nodes.items()},
                   frozenset(a for a, _ in fronts))

    @classmethod
    def replying_from(cls, endpoints: Iterable[tuple[object, int]]) -> StaleUdp:
        """The rule for endpoints that went away: (address, port) pairs."""
        return cls(endpoints_gone=frozenset((packed(ip), port) for ip, port in endpoints))

    def __bool__(self) -> bool:
        return bool(self.frontends or self.node_ports or self.endpoints_gone)

    def families(self) -> tuple[int, ...]:
        """The address families (socket.AF_INET, AF_INET6) worth listing."""
        keys = [a for a, _ in self.frontends] + [a for eps in self.node_ports.values() for a, _ in eps]
        keys += [a for a, _ in self.endpoints_gone]
        fams = {socket.AF_INET6 if len(a) == 16 else socket.AF_INET for a in keys}
        if self.node_ports:  # a NodePort with no endpoint left: its entries may be of either family
            fams |= {socket.AF_INET, socket.AF_INET6}
        return tuple(sorted(fams))

    def stale(self, orig_dst: HostPort, reply_src: HostPort) -> bool:
        """Whether a UDP entry (original destination, reply source) points at no serving
        endpoint of the frontend it was sent to."""
        if reply_src[0] == orig_dst[0]:
            return False  # not DNATed: the relay's flow, or not a Service's
        if reply_src in self.endpoints_gone:
            return True
        allowed = self.frontends.get(orig_dst)
        if allowed is None and orig_dst[0] not in self.addresses:
            allowed = self.node_ports.get(orig_dst[1])
        return allowed is not None and reply_src not in allowed

    def to_json(self) -> str:
        return json.dumps({
            "frontends": [[a.hex(), p, [[e.hex(), q] for e, q in sorted(eps)]]
                          for (a, p), eps in self.frontends.items()],
            "node_ports": [[p, [[e.hex(), q] for e, q in sorted(eps)]] for p, eps in self.node_ports.items()],
            "endpoints_gone": [[e.hex(), q] for e, q in sorted(self.endpoints_gone)]})

    @classmethod
    def from_json(cls, text: str) -> StaleUdp:
        raw = json.loads(text)
        fronts = {(bytes.fromhex(a), p): frozenset((bytes.fromhex(e), q) for e, q in eps)
                  for a, p, eps in raw["frontends"]}
        nodes = {p: frozenset((bytes.fromhex(e), q) for e, q in eps) for p, eps in raw["node_ports"]}
        gone = frozenset((bytes.fromhex(e), q) for e, q in raw.get("endpoints_gone", ()))
        return cls(fronts, nodes, frozenset(a for a, _ in fronts), gone)


def _add(fronts: dict[HostPort, set[HostPort]], nodes: dict[int, set[HostPort]], st: ServicePortState,
         serving: set[HostPort]) -> None:
    """Union per frontend: two ServicePorts on one frontend (a conflict FrontendClaims settles)
    keep each other's entries rather than delete them."""
    sp = st.service_port
    for ip, port in sp.frontends():
        fronts.setdefault((packed(ip), port), set()).update(serving)
    if sp.node_port:
        nodes.setdefault(sp.node_port, set()).update(serving)
