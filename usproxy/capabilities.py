"""Node capability probes for `usproxy check`: what can hold ClusterIPs, which kernel datapaths work.

Every probe returns a Capability (usproxy.offload.kernel_datapath) and never raises: a missing
feature is an answer, not an error. Interface probes create and delete a throwaway link
(`usproxy-probe`) through pyroute2.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from usproxy.offload.kernel_datapath import Capability

PROBE_LINK = "usproxy-probe"
NFT_PROBE = """table ip usproxy_probe {
  map m { type ipv4_addr . inet_service : ipv4_addr . inet_service ; }
  chain c {
    type nat hook prerouting priority dstnat;
    meta l4proto { tcp, udp } dnat ip to ip daddr . th dport map @m
    dnat ip to numgen random mod 2 map { 0 : 10.0.0.1, 1 : 10.0.0.2 }
  }
}
"""


def _netlink(fn: Callable[[Any], Capability]) -> Capability:
    import asyncio

    from pyroute2 import IPRoute

    ipr = IPRoute(use_event_loop=asyncio.SelectorEventLoop())
    try:
        return fn(ipr)
    finally:
        ipr.close()


def probe_link_kind(kind: str) -> Capability:
    """Can a link of `kind` (dummy, bridge) be created here?"""
    def probe(ipr: Any) -> Capability:
        try:
            ipr.link("add", ifname=PROBE_LINK, kind=kind)
        except Exception as err:
            code = getattr(err, "code", 0)
            why = f"{os.strerror(code)} (errno {code}): no {kind} driver" if code else str(err)
            return Capability(f"interface {kind}", False, why)
        idx = ipr.link_lookup(ifname=PROBE_LINK)
        if idx:
            ipr.link("del", index=idx[0])
        return Capability(f"interface {kind}", True, "can hold ClusterIPs")
    try:
        return _netlink(probe)
    except Exception as err:
        return Capability(f"interface {kind}", False, f"netlink: {err}")


def probe_nftables() -> Capability:
    nft = shutil.which("nft")
    if nft is None:
        return Capability("nftables", False, "nft not installed (apt-get install nftables)")
    res = subprocess.run([nft, "-c", "-f", "-"], input=NFT_PROBE, text=True, capture_output=True)
    if res.returncode != 0:
        return Capability("nftables", False, res.stderr.strip().splitlines()[-1] if res.stderr else "nft -c failed")
    return Capability("nftables", True, "nat maps, concatenations, numgen: ok")


def probe_bpf(cgroup: Path = Path("/sys/fs/cgroup/unified")) -> Capability:
    missing = []
    if not Path("/sys/kernel/btf/vmlinux").exists():
        missing.append("no BTF")
    if not (cgroup / "cgroup.procs").exists():
        missing.append(f"no cgroup v2 at {cgroup}")
    if ctypes.util.find_library("bpf") is None:
        missing.append("no libbpf.so (apt-get install libbpf1)")
    if shutil.which("clang") is None:
        missing.append("no clang")
    if missing:
        return Capability("bpf cgroup hooks", False, "; ".join(missing))
    from usproxy.offload.bpf.datapath import BpfDatapath

    real = BpfDatapath(cgroup).probe()  # creates a map and builds the object
    return Capability("bpf cgroup hooks", real.available, real.detail)


def probe_bpffs() -> Capability:
    mounts = Path("/proc/mounts").read_text().split("\n")
    where = [m.split()[1] for m in mounts if m.split()[2:3] == ["bpf"]]
    if where:
        return Capability("bpffs", True, f"mounted at {', '.join(where)}")
    return Capability("bpffs", True, "not mounted; usproxy mounts it at /sys/fs/bpf when needed")


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


def probe_ipvs() -> Capability:
    if Path("/proc/net/ip_vs").exists():
        return Capability("ipvs", True, "present (usproxy does not use it; explain renders it)")
    return Capability("ipvs", False, "CONFIG_IP_VS off (explain still renders IPVS tables)")


def probe_all(cgroup: Path = Path("/sys/fs/cgroup/unified")) -> list[Capability]:
    caps = [probe_link_kind("dummy"), probe_link_kind("bridge"),
            Capability("interface lo", os.path.exists("/sys/class/net/lo"), "last resort for ClusterIPs")]
    return [*caps, probe_nftables(), probe_bpf(cgroup), probe_bpffs(), probe_conntrack(), probe_ipvs()]
