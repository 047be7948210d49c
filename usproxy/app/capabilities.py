"""Node capability probes for `usproxy check`: what can hold ClusterIPs, which kernel datapaths work.

Every probe returns a Capability (usproxy.offload.kernel_datapath) and never raises: a missing
feature is an answer, not an error. Interface probes create and delete a throwaway link
(`usproxy-probe`) through the agent's netlink worker; the nftables and BPF probes are the
datapaths' own, so `usproxy check` and the agent cannot disagree.
"""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from usproxy.offload.kernel_datapath import Capability

if TYPE_CHECKING:
    from usproxy.offload.nftables.datapath import NftTransport

PROBE_LINK = "usproxy-probe"


def _netlink(fn: Callable[[Any], Capability]) -> Capability:
    """fn(IPRoute) in the agent's own netlink worker (the one IPRoute set-up, relay/vip_interface)."""
    from usproxy.relay.vip_interface import NetlinkWorker

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


def probe_nftables(transport: NftTransport | None = None) -> Capability:
    """The agent's own nftables probe (nftables.datapath.probe_capability) through `transport`
    (default: libnftables in this network namespace), so `usproxy check` and the agent agree."""
    from usproxy.offload.nftables.client import NftClient
    from usproxy.offload.nftables.datapath import probe_capability

    client = transport if transport is not None else NftClient()
    try:
        return probe_capability(client)
    finally:
        client.close()


def probe_bpf(cgroup: Path = Path("/sys/fs/cgroup/unified")) -> Capability:
    missing = []
    if not Path("/sys/kernel/btf/vmlinux").exists():
        missing.append("no BTF")
    if not (cgroup / "cgroup.procs").exists():
        missing.append(f"no cgroup v2 at {cgroup}")
    if ctypes.util.find_library("bpf") is None:
        missing.append("no libbpf.so (apt-get install libbpf1)")
    if missing:  # no clang is not a gap here: a wheel or image ships the object prebuilt
        # (the datapath's own probe below finds it, or says that it cannot compile one)
        return Capability("bpf cgroup hooks", False, "; ".join(missing))
    from usproxy.offload.bpf.datapath import BpfDatapath

    real = BpfDatapath(cgroup).probe()  # creates a map and builds the object
    return Capability("bpf cgroup hooks", real.available, real.detail)


def probe_bpf_tc() -> Capability:
    """Can the tc programs (NodePorts, LoadBalancer IPs and externalIPs from outside the node,
    `--offload bpf`) load and attach with tcx here? Attaches usp_tc_ingress to a throwaway veth
    (PROBE_LINK, its peer goes with it) and detaches it (usproxy.offload.bpf.loader.probe_tc_attach); without it
    external traffic stays with nftables or the relay."""
    name = "bpf tc (tcx) attach"

    def make(ipr: Any) -> int:
        drop(ipr)  # one a crashed probe left
        ipr.link("add", ifname=PROBE_LINK, kind="veth", peer=PROBE_LINK + "-p")  # veth: every kernel with tcx has it
        return int(ipr.link_lookup(ifname=PROBE_LINK)[0])

    def drop(ipr: Any) -> Capability:
        for idx in ipr.link_lookup(ifname=PROBE_LINK):
            ipr.link("del", index=idx)
        return Capability(name, True, "")

    try:
        from usproxy.offload.bpf import loader
        from usproxy.relay.vip_interface import NetlinkWorker

        worker = NetlinkWorker()
        try:
            ifindex = worker.call_sync(make)
            try:
                loader.probe_tc_attach(ifindex)
            finally:
                worker.call_sync(drop)
        finally:
            worker.close()
    except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
        return Capability(name, False, f"{type(err).__name__}: {err}; external traffic stays with nftables or the relay")
    return Capability(name, True, "usp_tc_ingress attached to a veth and detached: NodePorts, LoadBalancer "
                                  "IPs and externalIPs can be served at tc (--offload bpf)")
def probe_xdp() -> Capability:
    """Which interfaces could serve NodePorts at XDP (--bpf-lb-acceleration native): the
    interfaces the tc programs would hook, by their drivers' xdp-features and, for a veth, whether
    its peer runs XDP (xdp.py; nothing attached)."""
    try:
        from usproxy.offload.bpf import nodeport, xdp

        hooked = nodeport.interfaces(())
        plan = xdp.probe(hooked)
    except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
        return Capability("bpf xdp", False, f"{type(err).__name__}: {err}")
    detail = plan.detail({h.ifindex: h.name for h in hooked}) or "no interface with a NodePort address"
    return Capability("bpf xdp", bool(plan.ifindexes), detail)


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
    return [*caps, probe_nftables(), probe_bpf(cgroup), probe_bpf_tc(), probe_xdp(), probe_bpffs(), probe_conntrack(), probe_ipvs()]
