"""Node capability probes for `usproxy check`: what can hold ClusterIPs, which kernel datapaths work.

Every probe returns a Capability (usproxy.offload.kernel_datapath) and never raises: a missing
feature is an answer, not an error; a probe the kernel refused for want of privilege (EPERM) says
"not permitted", never that a driver is missing (`usproxy check` then exits 1: app/cli.py).
Interface probes create and delete a throwaway link (`usproxy-probe`) through the agent's netlink
worker; each kernel datapath's probes are its declaration's (usproxy/offload/registry.py), the
datapaths' own, so `usproxy check` and the agent cannot disagree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
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
    return Capability("conntrack", True, f"{n} {'entry' if n == 1 else 'entries'} readable")


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


def unprivileged(caps: list[Capability]) -> list[Capability]:
    """The rows as a process without CAP_NET_ADMIN must show them: a "no" the kernel gave for want
    of privilege says "not permitted", with what the probe saw after it; any other "no" says it
    was probed without the capability (an iptables probe refused for want of privilege otherwise
    reads as missing matches), since the feature may be there all the same."""
    out = []
    for c in caps:
        if not c.available and c.detail != NOT_PERMITTED:
            refused = any(w in c.detail for w in _PERMISSION_WORDS)
            c = replace(c, detail=f"{NOT_PERMITTED}; the probe saw: {c.detail}" if refused else
                        f"{c.detail} (probed without CAP_NET_ADMIN: it may be a refusal, not a missing feature)")
        out.append(c)
    return out


_PERMISSION_WORDS = ("Operation not permitted", "Permission denied", "you must be root", "EPERM")


@contextlib.contextmanager
def stderr_captured() -> Iterator[Callable[[], str]]:
    """File descriptor 2 redirected to a temporary file for the block (libnftables prints "Operation
    not permitted (you must be root)" there itself when its context opens without privilege);
    yields a function returning what was written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        def written() -> str:
            tmp.seek(0)
            return tmp.read().decode(errors="replace")

        os.dup2(tmp.fileno(), 2)
        try:
            yield written
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
