"""Node capability probes for `usproxy check`: what can hold ClusterIPs, which kernel datapaths work.

Every probe returns a Capability (usproxy.offload.kernel_datapath) and never raises: a missing
feature is an answer, not an error; a probe the kernel refused for want of privilege (EPERM) says
"not permitted", never that a driver is missing (`usproxy check` then exits 1: app/cli.py).
Interface probes create and delete a throwaway link (`usproxy-probe`) through the agent's netlink
worker; each kernel datapath's probes are its declaration's (usproxy/offload/registry.py), the
datapaths' own, so `usproxy check` and the agent cannot disagree.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from usproxy.model.config import ProxyConfig
from usproxy.offload.kernel_datapath import Capability

PROBE_LINK = "usproxy-probe"
NOT_PERMITTED = "not permitted: needs CAP_NET_ADMIN (run usproxy check as root)"


def _netlink(fn: Callable[[Any], Capability]) -> Capability:
    """fn(IPRoute) in the agent's own netlink worker (the one IPRoute set-up, util/netlink_worker)."""
    from usproxy.util.netlink_worker import NetlinkWorker

    worker = NetlinkWorker()
    try:
        return worker.call_sync(fn)
    finally:
        worker.close()


def probe_link_kind(kind: str) -> Capability:
    """Can a link of `kind` (dummy, bridge) be created here?"""
    def probe(ipr: Any) -> Capability:
        try:
            ipr.link("add", ifname=PROBE_LINK, kind=kind)
        except Exception as err:
            code = getattr(err, "code", 0)
            why = (NOT_PERMITTED if code in (errno.EPERM, errno.EACCES) else
                   f"{os.strerror(code)} (errno {code}): no {kind} driver" if code else str(err))
            return Capability(f"interface {kind}", False, why)
        idx = ipr.link_lookup(ifname=PROBE_LINK)
        if idx:
            ipr.link("del", index=idx[0])
        return Capability(f"interface {kind}", True, "can hold ClusterIPs")
    try:
        return _netlink(probe)
    except Exception as err:
        return Capability(f"interface {kind}", False, f"netlink: {err}")


def probe_conntrack() -> Capability:
    if not Path("/proc/sys/net/netfilter/nf_conntrack_max").exists():
        return Capability("conntrack", False, "nf_conntrack not loaded")
    try:
        from pyroute2 import Conntrack

        ct = Conntrack()
        try:
            n = len(list(ct.dump()))
        finally:
            ct.close()
    except Exception as err:
        return Capability("conntrack", False, f"pyroute2 Conntrack: {err}")
    return Capability("conntrack", True, f"{n} entries readable")


def probe_relay_capture() -> Capability:
    """The relay's own choice of how to capture a frontend whose port a node socket holds
    (usproxy/relay/port_capture.py `choose`, which installs nothing)."""
    import asyncio

    from usproxy.relay.port_capture import choose

    mode, why = asyncio.run(choose("auto", {}))
    return Capability("relay capture", mode != "none", f"{mode}: {why}" if mode != "none" else why)


def probe_all(cfg: ProxyConfig = ProxyConfig()) -> list[Capability]:
    """Interfaces for ClusterIPs, then every declared kernel datapath's probes in ladder order,
    then conntrack and the relay's capture of held ports (IPVS is a datapath of the registry: its
    probe is there)."""
    from usproxy.offload import registry

    caps = [probe_link_kind("dummy"), probe_link_kind("bridge"),
            Capability("interface lo", os.path.exists("/sys/class/net/lo"), "last resort for ClusterIPs")]
    for d in registry.KERNEL_DATAPATHS:
        caps += d.probes(cfg)
    return [*caps, probe_conntrack(), probe_relay_capture()]
