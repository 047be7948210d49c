"""The lab's scenarios: one machine each (architecture, vCPUs, memory, kernel command line, cgroup
layout) and the guest script that judges it (lab/guest/scenario.py, by name).

Features are taken away by the kernel itself: a module named in `modprobe.blacklist=` cannot be
loaded by anyone in the guest, and Debian's 6.1 kernel has nf_tables, ip_tables and x_tables only
as modules. Blacklisting the module a family's every other module depends on (nf_tables for the
nft_* expressions, x_tables for ip_tables, ip6_tables and every xt_ match) takes the whole family.
cgroup v2 cannot be compiled out of that kernel; "cgroup v1 only" is a guest whose init mounts the
v1 controllers and no cgroup2 hierarchy, as a node booted with systemd's legacy hierarchy has; "v2"
mounts cgroup2 alone at /sys/fs/cgroup, as most distributions do since 2021.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Arch = Literal["amd64", "arm64"]
Cgroups = Literal["hybrid", "v1", "v2"]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    arch: Arch
    smp: int
    memory_mib: int
    blacklist: tuple[str, ...] = ()
    # hybrid: v1 controllers plus cgroup2 at /sys/fs/cgroup/unified; v2: cgroup2 alone at
    # /sys/fs/cgroup; v1: no cgroup2. The agent's default --bpf-cgroup is found in the mount table
    cgroups: Cgroups = "hybrid"
    load_modules: tuple[str, ...] = ()  # loaded by the guest's init before the scenario starts
    timeout_s: float = 900.0  # the whole boot-to-poweroff, beyond which the lab gives up
    soak_s: float = 0.0  # edge: default soak length (--duration overrides)
    summary: str = ""
    # Debian packages of the guest's release that one scenario needs, installed at boot with
    # dpkg -i from .debs the host downloads (lab/debs.py): kept out of the cached root, whose
    # package list is its cache key (a new key rebuilds the root and evicts every other one).
    debs: tuple[str, ...] = ()


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("no-nftables", "amd64", 2, 1024, blacklist=("nf_tables",),
             summary="kernel without nf_tables: the ladder lands on iptables (legacy), or the relay"),
    Scenario("no-xtables", "amd64", 2, 1024, blacklist=("nf_tables", "x_tables", "ip_tables", "ip6_tables"),
             cgroups="v2", summary="kernel without nf_tables and ip_tables, cgroup v2 alone at /sys/fs/cgroup: "
                                   "netfilter offload impossible, the relay serves, the socket LB found there"),
    Scenario("cgroup1", "amd64", 2, 1024, cgroups="v1",
             summary="cgroup v1 only: no BPF socket LB, nftables serves ClusterIPs"),
    Scenario("ipvs", "amd64", 2, 1024, load_modules=("ip_vs", "ip_vs_rr"), debs=("ipset", "libipset13"),
             summary="ip_vs loaded and the ipset tool (kube-proxy's IPVS mode needs both): the IPVS datapath serves"),
    Scenario("edge-256", "amd64", 1, 256, timeout_s=1500.0, soak_s=600.0,
             summary="1 vCPU, 256 MiB, 100 Services, offload on, a soak with an endpoint change every second"),
    Scenario("arm64", "arm64", 2, 1024, timeout_s=1500.0,
             summary="arm64 board: the same wheel, relay, nftables and BPF offload, explain"),
)}
