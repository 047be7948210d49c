"""VipInterface: ClusterIPs (and external IPs) made local on an interface usproxy owns.

As IPVS mode's kube-ipvs0: a dummy device `usproxy0` where the kernel has the dummy driver. Where
it does not (this project's machines), fall back to an empty bridge, and as a last resort to `lo`;
the choice is logged and reported (`kind`, `why`). An IPv4 address is made local by a local route
via the interface (`local ADDR dev usproxy0 table local src ADDR`, the route the kernel itself
adds for an address: address_batch.py), which the kernel treats as an address for delivery,
bind(), ARP and the source of a node's own connections, at O(log n) instead of an address's O(n)
per add (10,000: 0.09 s of kernel time, not 1.2 s). An IPv6 address is an address, /128 with
IFA_F_NODAD so it can be bound at once: IPv6 picks a node's source address among addresses only,
and a local route cannot name one that is not configured. Addresses an earlier agent left (both
kinds, and IPv4 addresses of older versions) are found at setup and removed as what they are.
All netlink calls run in one dedicated worker thread (pyroute2's
sync API cannot run inside a running event loop, and its async API fails under uvloop; see
docs/platform.md#pyroute2-and-uvloop). On close the interface and its addresses stay by default
(`keep`), as IPVS mode's kube-ipvs0 does: during an agent restart new connections to a ClusterIP are refused at once by the
kernel instead of being unroutable, and offloaded traffic from local processes keeps its route
(C20). `usproxy run --cleanup` removes the interface (and with it its routes); `keep = False`
removes on close.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import Iterable
from ipaddress import IPv4Address
from typing import Any

from usproxy.model.types import IPAddress
from usproxy.util.netlink_worker import NetlinkWorker
from usproxy.relay.address_batch import (add_addresses, add_local_routes, delete_local_routes, is_routed, local_routes,
                                         routes_for_addresses)

log = logging.getLogger(__name__)
IFA_F_NODAD = 0x02
KINDS = ("dummy", "bridge")


def _link_index(ipr: Any, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return int(found[0]) if found else None


def _create(ipr: Any, name: str) -> tuple[int, str, str]:
    """Find or create the interface; returns (index, kind, why)."""
    idx = _link_index(ipr, name)
    if idx is not None:
        kind = ipr.get_links(idx)[0].get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") or "unknown"
        ipr.link("set", index=idx, state="up")
        return idx, str(kind), f"reusing existing {kind} {name}"
    failures = []
    for kind in KINDS:
        try:
            ipr.link("add", ifname=name, kind=kind)
        except Exception as err:  # NetlinkError: EOPNOTSUPP / ENODEV when the driver is missing
            failures.append(f"{kind}: {err}")
            continue
        idx = _link_index(ipr, name)
        assert idx is not None
        ipr.link("set", index=idx, state="up")
        why = f"created {kind} {name}" + (f" (no {', '.join(f.split(':')[0] for f in failures)})" if failures else "")
        return idx, kind, why
    idx = _link_index(ipr, "lo")
    assert idx is not None
    return idx, "lo", f"holding ClusterIPs on lo ({'; '.join(failures)})"


class VipInterface:
    """The interface that holds ClusterIPs; `add_many`/`remove` are reference counted by caller."""

    def __init__(self, name: str = "usproxy0", worker: NetlinkWorker | None = None) -> None:
        self.name = name
        self.worker = worker or NetlinkWorker()
        self.index = 0
        self.kind = "none"
        self.why = "not set up"
        self.created = False
        self.addresses: set[IPAddress] = set()  # every address made local here
        self.routed: set[IPv4Address] = set()  # those of them made local by a route, not an address
        self.keep = True

    async def setup(self) -> None:
        existed = await self.worker.call(lambda ipr: _link_index(ipr, self.name))
        self.index, self.kind, self.why = await self.worker.call(lambda ipr: _create(ipr, self.name))
        self.created = existed is None and self.kind != "lo"
        log.info("ClusterIP interface: %s", self.why)
        found = await self.existing()
        routes = await self.worker.call(lambda _: local_routes(self.index))
        old = sorted(ip for ip in found if isinstance(ip, IPv4Address))
        if old:  # an earlier version's: routes now, every one at once (routes_for_addresses)
            await self.worker.call(lambda _: routes_for_addresses(self.index, old, sorted(routes)))
            log.info("%d IPv4 addresses on %s are local routes now", len(old), self.name)
        self.routed = routes.union(old)
        self.addresses = found | self.routed

    async def repair(self) -> bool:
        """Add every routed address again when the kernel dropped its routes (it flushes every
        route via an interface that loses its last IPv4 address, say one an administrator added
        and removed; a link going down and up keeps local routes); True when it did. One route lookup when
        nothing is missing. Raises OSError."""
        if not self.routed:
            return False
        ip = next(iter(self.routed))
        if await self.worker.call(lambda _: is_routed(self.index, ip)):
            return False
        ips = sorted(self.routed)
        await self.worker.call(lambda _: add_local_routes(self.index, ips))
        log.warning("the local routes of %s were gone (the interface lost its last IPv4 address): "
                    "added %d again", self.name, len(ips))
        return True

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        """Make addresses local in one trip to the netlink thread, packed many to a system call
        (address_batch.py: a cold sync of 10,000 Services costs ~80 sendmsg, not 10,000 round
        trips through pyroute2): IPv4 by local routes, IPv6 as addresses. Raises OSError (the
        sync fails and is retried: EEXIST counts as added)."""
        new = sorted({ip for ip in ips if ip not in self.addresses}, key=lambda a: (a.version, int(a)))
        if not new:
            return
        v4 = [ip for ip in new if isinstance(ip, IPv4Address)]
        v6 = new[len(v4):]

        def add(_: Any) -> None:
            if v4:
                add_local_routes(self.index, v4)
            if v6:
                add_addresses(self.index, v6, IFA_F_NODAD)
        await self.worker.call(add)
        self.routed.update(v4)
        self.addresses.update(new)

    async def remove(self, ip: IPAddress) -> None:
        if ip not in self.addresses:
            return
        self.addresses.discard(ip)
        if ip in self.routed:
            assert isinstance(ip, IPv4Address)
            self.routed.discard(ip)
            await self.worker.call(lambda _: delete_local_routes(self.index, [ip]))
            return
        plen = 32 if ip.version == 4 else 128

        def delete(ipr: Any) -> None:
            try:
                ipr.addr("del", index=self.index, address=str(ip), prefixlen=plen)
            except Exception as err:
                if getattr(err, "code", None) not in (errno.EADDRNOTAVAIL, errno.ENOENT, errno.ENODEV):
                    raise
        await self.worker.call(delete)

    async def local_addresses(self) -> list[tuple[str, IPAddress]]:
        """(interface name, address) of every address on this host, for NodePort binding."""
        def dump(ipr: Any) -> list[tuple[str, IPAddress]]:
            names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
            return [(names.get(a["index"], "?"), ipaddress.ip_address(a.get_attr("IFA_ADDRESS")))
                    for a in ipr.get_addr()]
        return await self.worker.call(dump)

    async def existing(self) -> set[IPAddress]:
        """Addresses already on the interface (left by a previous agent; its local routes are
        read by setup). Not the interface's own IPv6 link-local address: no Service has one."""
        name = self.name
        return {ip for ifname, ip in await self.local_addresses()
                if ifname == name and self.kind != "lo" and not ip.is_link_local}

    async def delete(self) -> bool:
        """Remove the interface (for --cleanup); False when there is none or it is `lo`."""
        idx = await self.worker.call(lambda ipr: _link_index(ipr, self.name))
        if idx is None or self.name == "lo":
            return False
        await self.worker.call(lambda ipr: ipr.link("del", index=idx))
        return True

    async def close(self) -> None:
        if not self.keep:
            for ip in list(self.addresses):
                try:
                    await self.remove(ip)
                except Exception:
                    log.exception("removing %s from %s", ip, self.name)
            if self.created:
                await self.worker.call(lambda ipr: ipr.link("del", index=self.index))
        self.worker.close()
