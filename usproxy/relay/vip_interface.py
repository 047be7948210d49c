"""VipInterface: ClusterIPs (and external IPs) as local addresses on an interface usproxy owns.

As IPVS mode's kube-ipvs0: a dummy device `usproxy0` where the kernel has the dummy driver. Where
it does not (this project's machines), fall back to an empty bridge, and as a last resort to `lo`;
the choice is logged and reported (`kind`, `why`). Addresses are /32 or /128 with IFA_F_NODAD so
IPv6 ones can be bound at once. All netlink calls run in one dedicated worker thread (pyroute2's
sync API cannot run inside a running event loop, and its async API fails under uvloop; see
docs/platform.md#pyroute2-and-uvloop). On close the interface and its addresses stay by default
(`keep`), as IPVS mode's kube-ipvs0 does: during an agent restart new connections to a ClusterIP are refused at once by the
kernel instead of being unroutable, and offloaded traffic from local processes keeps its route
(C20). `usproxy run --cleanup` removes the interface; `keep = False` removes on close.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

from usproxy.model.types import IPAddress
from usproxy.util.netlink_worker import NetlinkWorker
from usproxy.util.netlink_batch import add_addresses

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
        self.addresses: set[IPAddress] = set()
        self.keep = True

    async def setup(self) -> None:
        existed = await self.worker.call(lambda ipr: _link_index(ipr, self.name))
        self.index, self.kind, self.why = await self.worker.call(lambda ipr: _create(ipr, self.name))
        self.created = existed is None and self.kind != "lo"
        self.addresses = await self.existing()
        log.info("ClusterIP interface: %s", self.why)

    async def add_many(self, ips: Iterable[IPAddress]) -> None:
        """Add addresses in one trip to the netlink thread, packed many to a system call
        (util/netlink_batch.py: a cold sync of 10,000 Services costs ~20 sendmsg, not 10,000 round
        trips through pyroute2). Raises OSError (the sync fails and is retried: EEXIST counts as
        added)."""
        new = sorted({ip for ip in ips if ip not in self.addresses}, key=lambda a: (a.version, int(a)))
        if not new:
            return
        await self.worker.call(lambda _: add_addresses(self.index, new, IFA_F_NODAD))
        self.addresses.update(new)

    async def remove(self, ip: IPAddress) -> None:
        if ip not in self.addresses:
            return
        self.addresses.discard(ip)
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
        """Addresses already on the interface (left by a previous agent)."""
        name = self.name
        return {ip for ifname, ip in await self.local_addresses() if ifname == name and self.kind != "lo"}

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
