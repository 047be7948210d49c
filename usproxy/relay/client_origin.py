"""ClientOrigin: whether a relayed client is a pod or the node itself, as kube-proxy tells them.

kube-proxy sends traffic from a pod (its local-traffic detector: a source in the ClusterCIDR or
this node's pod CIDR, or arriving on the pod bridge or an interface of the pod prefix) and from
the node itself (`fib saddr type local`) to an externalTrafficPolicy Local Service's NodePort,
externalIPs and LoadBalancer IPs on to every endpoint ("short-circuit"); only other clients are
held to the local endpoints, or dropped when there is none. The relay accepts each connection
itself and knows its peer, so it decides the same per connection (TCP) or flow (UDP):

- `internal(client)`: the node's own addresses (any interface, `usproxy0` included: a process
  that connects to an address there takes that address as its source) or, by the detector, the
  pod CIDRs; with an interface detector, the interface the route back to the client leaves by
  (one RTM_GETROUTE, `route_back`), as symmetric routing and rp_filter take the path in.
- `clauses(family)`: the same decision as a socket filter clause (source_filter.py) for a listener
  that drops everyone else: the detector's CIDR of that family, and the interfaces packets of the
  node (`lo`) and, for an interface detector, of pods arrive on (indexes resolved by `refresh`,
  which the relay calls on each sync and sweep: pod interfaces come and go).

A family without a detector CIDR detects no pod there, as kube-proxy's no-op detector; the node
itself is always recognised (kube-proxy's `fib saddr type local` needs no detector).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Literal

from usproxy.model.local_detector import LocalDetector
from usproxy.model.types import IPAddress
from usproxy.relay.source_filter import LOOPBACK_IFINDEX, Clause

log = logging.getLogger(__name__)

_RTM_NEWROUTE, _RTM_GETROUTE, _NLMSG_ERROR = 24, 26, 2
_NLM_F_REQUEST = 0x1
_RTA_DST, _RTA_OIF = 1, 4
RTN_LOCAL = 2


class ClientOrigin:
    """Tells pods and the node from other clients. `is_node(ip)`: whether an address is one of
    this node's (the relay's view of its interfaces and of `usproxy0`)."""

    def __init__(self, detector: LocalDetector, is_node: Callable[[IPAddress], bool]) -> None:
        self.detector = detector
        self.is_node = is_node
        # the detector's CIDRs as (version, network, mask) integers: a containment test in ~0.2 us
        self._nets = tuple((n.version, int(n.network_address), int(n.netmask)) for n in detector.cidrs)
        self.ifindexes: tuple[int, ...] = ()  # pod interfaces of an interface detector, now
        self._route: RouteBack | None = None

    @property
    def by_interface(self) -> bool:
        return self.detector.mode in ("BridgeInterface", "InterfaceNamePrefix")

    def internal(self, client: str) -> bool:
        """Whether `client` (an address as a socket reports it) is a pod or the node itself."""
        try:
            ip = ipaddress.ip_address(client.split("%", 1)[0])
        except ValueError:
            return False
        value = int(ip)
        if any(v == ip.version and value & mask == net for v, net, mask in self._nets) or self.is_node(ip):
            return True
        if not self.by_interface:
            return False
        try:
            if self._route is None:
                self._route = RouteBack()
            kind, ifindex = self._route.lookup(ip)
        except OSError as err:
            log.warning("route back to %s: %s; taken as an outside client", client, err)
            return False
        return kind == RTN_LOCAL or self._pod_interface(ifindex)

    def _pod_interface(self, ifindex: int) -> bool:
        try:
            name = socket.if_indextoname(ifindex)
        except OSError:
            return False
        if self.detector.mode == "BridgeInterface":
            return name == self.detector.interface
        return name.startswith(self.detector.interface)

    def refresh(self) -> bool:
        """Read the indexes of the detector's interfaces again; True when they changed."""
        if not self.by_interface:
            return False
        want = self.detector.interface
        prefix = self.detector.mode == "InterfaceNamePrefix"
        found = tuple(sorted(i for i, name in socket.if_nameindex()
                             if name == want or (prefix and name.startswith(want))))
        changed, self.ifindexes = found != self.ifindexes, found
        return changed

    def clause(self, family: Literal[4, 6]) -> Clause:
        """The socket filter clause that accepts pods and the node on a listener of `family`."""
        cidrs = tuple(n for n in self.detector.cidrs if n.version == family)
        return Clause(cidrs, (LOOPBACK_IFINDEX, *self.ifindexes))

    def close(self) -> None:
        if self._route is not None:
            self._route.close()
            self._route = None


class RouteBack:
    """The kernel's route to an address (RTM_GETROUTE on a netlink socket of its own): its type
    (RTN_LOCAL for this node's own addresses) and the interface it leaves by. Blocking, but the
    kernel answers within the call (tens of microseconds)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def lookup(self, ip: IPAddress) -> tuple[int, int]:
        """(rtm_type, output interface index) of the route to `ip`; raises OSError."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        addr = ip.packed
        attr = struct.pack("=HH", 4 + len(addr), _RTA_DST) + addr
        body = struct.pack("=BBBBBBBBI", family, 8 * len(addr), 0, 0, 0, 0, 0, 0, 0) + attr
        self.sock.send(struct.pack("=LHHLL", 16 + len(body), _RTM_GETROUTE, _NLM_F_REQUEST, self.seq, 0) + body)
        while True:
            buf = self.sock.recv(65536)
            length, kind, _, seq = struct.unpack_from("=LHHL", buf)
            if seq != self.seq:
                continue  # an answer to a lookup that raised before reading it
            if kind == _NLMSG_ERROR:
                code = -struct.unpack_from("=i", buf, 16)[0]
                raise OSError(code, f"route lookup: {os.strerror(code)}")
            if kind != _RTM_NEWROUTE:
                raise OSError(0, f"route lookup: unexpected netlink message {kind}")
            return buf[16 + 7], _oif(buf, 16 + 12, length)

    def close(self) -> None:
        self.sock.close()


def _oif(buf: bytes, start: int, end: int) -> int:
    while start + 4 <= end:
        alen, atype = struct.unpack_from("=HH", buf, start)
        if atype == _RTA_OIF and alen >= 8:
            return int(struct.unpack_from("=I", buf, start + 4)[0])
        start += (max(alen, 4) + 3) & ~3
    return 0
