"""`usproxy check`'s probes of the BPF datapath: cgroup hooks (the socket LB), tc (tcx) attach,
XDP per interface, bpffs. Each returns a Capability and never raises; the socket-LB probe is the
datapath's own (BpfDatapath.probe), so `usproxy check` and the agent cannot disagree. The tc probe
attaches usp_tc_ingress to a throwaway veth (PROBE_LINK, its peer goes with it) and detaches it.
"""

from __future__ import annotations

import ctypes.util
from pathlib import Path
from typing import Any

from usproxy.offload.kernel_datapath import Capability

PROBE_LINK = "usproxy-probe"


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
        from usproxy.util.netlink_worker import NetlinkWorker

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
