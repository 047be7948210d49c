"""`usproxy check`'s probes of the BPF datapath: cgroup hooks (the socket LB), tc attach and its
rung (tcx, or a clsact qdisc's cls_bpf filters), XDP per interface, bpffs, the map sizes. Each
returns a Capability and never raises; the socket-LB probe is the datapath's own (BpfDatapath.probe), and the tc rung and the map sizes are chosen by the functions
the datapath calls (cls_bpf.rung, map_sizes.plan), so `usproxy check` and the agent cannot
disagree. The tc probe attaches usp_tc_ingress to a throwaway veth (PROBE_LINK, its peer goes with
it) and removes it.
"""

from __future__ import annotations

import ctypes.util
from pathlib import Path
from typing import Any

from usproxy.offload.bpf.map_sizes import MapSizeFlags
from usproxy.offload.kernel_datapath import Capability
from usproxy.util import cgroup2

PROBE_LINK = "usproxy-probe"


def probe_bpf(cgroup: Path | None = None) -> Capability:
    """The socket LB's probe, at `cgroup` (where this host mounts cgroup v2 when None)."""
    cgroup = cgroup if cgroup is not None else cgroup2.mount_point()
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


def probe_bpf_tc(enable_tcx: bool = True) -> Capability:
    """Can the tc programs (NodePorts, LoadBalancer IPs and externalIPs from outside the node,
    `--offload bpf`) load and attach here, and on which rung? tcx where the kernel has it, else a
    clsact qdisc's cls_bpf filters (cls_bpf.rung: probed, not by version); usp_tc_ingress is
    attached that way to a throwaway veth (PROBE_LINK, its peer goes with it) and removed
    (usproxy.offload.bpf.loader.probe_tc_attach); without it external traffic stays with
    nftables or the relay."""
    name = "bpf tc attach"

    def make(ipr: Any) -> int:
        drop(ipr)  # one a crashed probe left
        ipr.link("add", ifname=PROBE_LINK, kind="veth", peer=PROBE_LINK + "-p")  # veth: every kernel with BPF has it
        return int(ipr.link_lookup(ifname=PROBE_LINK)[0])

    def drop(ipr: Any) -> Capability:
        for idx in ipr.link_lookup(ifname=PROBE_LINK):
            ipr.link("del", index=idx)
        return Capability(name, True, "")

    why = "tc"
    try:
        from usproxy.offload.bpf import cls_bpf, loader
        from usproxy.util.netlink_worker import NetlinkWorker

        how, why = cls_bpf.rung(enable_tcx)
        worker = NetlinkWorker()
        try:
            ifindex = worker.call_sync(make)
            try:
                loader.probe_tc_attach(ifindex, how)
            finally:
                worker.call_sync(drop)
        finally:
            worker.close()
    except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
        return Capability(name, False, f"{why}: {type(err).__name__}: {err}; external traffic stays with nftables "
                                       "or the relay")
    return Capability(name, True, f"{why}: usp_tc_ingress attached to a veth and removed: NodePorts, LoadBalancer "
                                  "IPs and externalIPs can be served at tc (--offload bpf)")


def probe_bpf_map_sizes(flags: MapSizeFlags = MapSizeFlags()) -> Capability:
    """How the BPF maps are sized on this machine (map_sizes.py), with and without the tc programs
    (`--offload bpf`; `auto` leaves them out), and what they cost the kernel (estimated)."""
    from usproxy.offload.bpf import map_sizes

    try:
        memory = map_sizes.total_memory()
    except OSError as err:
        return Capability("bpf map sizes", False, f"MemTotal unreadable: {err}")
    local, tc = (map_sizes.plan(flags, memory, tc=t) for t in (False, True))
    return Capability("bpf map sizes", True, f"{tc.detail()}; without the tc programs (--offload auto) about "
                                             f"{local.kernel_bytes() / 2**20:.1f} MiB")


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
