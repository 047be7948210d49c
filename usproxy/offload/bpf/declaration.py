"""The BPF datapath as the registry declares it (usproxy/offload/registry.py).

Light to import: libbpf, the BPF object and the datapath load only when one of these functions
runs. Its pins are node-wide (bpffs), so an agent running it holds the pin root's lock
(pin_root.PinsLock) besides its network namespace's, and an agent without it removes an earlier
run's programs and pins only under that lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usproxy.core.datapath import ExternalServing, KernelWriteCounter, NodeAddressFollower
from usproxy.offload.kernel_datapath import ALL_TRAFFIC, BuildContext, Capability, KernelDatapath, KernelDatapathDeclaration
from usproxy.offload.pin_root import PinsLock, default_pin_root, has_pins

if TYPE_CHECKING:
    from usproxy.model.config import ProxyConfig


def build(ctx: BuildContext) -> KernelDatapath:
    """The socket LB; the tc (and XDP) programs for NodePorts, LB IPs and externalIPs only when
    BPF is asked for by name (`--offload bpf`): `auto` leaves external traffic to nftables."""
    from usproxy.offload.bpf.datapath import BpfDatapath

    s = ctx.settings
    nodeport = ctx.node.nodeport_cidrs if s.mode == "bpf" else None
    return BpfDatapath(s.bpf_cgroup, selection=s.lb_policy, nodeport_cidrs=nodeport, lb_mode=s.bpf_lb_mode,
                       acceleration=s.bpf_lb_acceleration, map_sizes=s.bpf_map_sizes, enable_tcx=s.bpf_enable_tcx)


def probes(cfg: ProxyConfig) -> list[Capability]:
    from usproxy.offload.bpf import probes as p

    from usproxy.offload.settings import map_size_flags

    return [p.probe_bpf(cfg.bpf_cgroup), p.probe_bpf_tc(cfg.enable_tcx), p.probe_xdp(), p.probe_bpffs(),
            p.probe_bpf_map_sizes(map_size_flags(cfg))]


async def leftovers(cfg: ProxyConfig) -> list[str]:
    root = default_pin_root()
    return [f"BPF programs and pins under {root}"] if has_pins(root) else []


async def remove(cfg: ProxyConfig) -> None:
    """Detach the programs pinned under the pin root (socket LB on --bpf-cgroup, tc, XDP) and
    remove the pins. Where libbpf cannot even be loaded, nothing can have been pinned with it."""
    try:
        from usproxy.offload.bpf.datapath import BpfDatapath
    except ImportError:
        return
    dp = BpfDatapath(cfg.bpf_cgroup, default_pin_root())
    try:
        await dp.cleanup()
    finally:
        dp.close()


def lock(cfg: ProxyConfig) -> PinsLock:
    return PinsLock(default_pin_root())


DECLARATION = KernelDatapathDeclaration(
    name="bpf",
    summary="a BPF socket load balancer at connect() (this node's connections), and with --offload bpf tc/XDP "
            "programs for NodePorts, LB IPs and externalIPs",
    serves=ALL_TRAFFIC,  # forwarded only through the tc programs (--offload bpf), else local
    # random: a random slot per connect; roundRobin: a shared counter per ServicePort. No
    # leastConnections: the socket LB keeps no per-endpoint connection counts.
    lb_policies=frozenset({"random", "roundRobin"}),
    build=build,
    probes=probes,
    leftovers=leftovers,
    remove=remove,
    lock=lock,
    optional=(NodeAddressFollower, ExternalServing, KernelWriteCounter),
)
