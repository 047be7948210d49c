"""The iptables datapath as the registry declares it (usproxy/offload/registry.py).

Light to import: the datapath, its generator and its worker threads load only when one of these
functions runs. Its rules are per network namespace (both backends' KUBE-* chains), so the
agent's network namespace offload lock covers it and no further lock is declared. It sits below
nftables on the ladder: it is what a kernel without nf_tables (or one whose nftables probe
fails) can still offload to, with iptables-legacy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usproxy.core.datapath import KernelWriteCounter, UdpConntrackReconciler
from usproxy.offload.kernel_datapath import ALL_TRAFFIC, BuildContext, Capability, KernelDatapath, KernelDatapathDeclaration

if TYPE_CHECKING:
    from usproxy.model.config import ProxyConfig


def build(ctx: BuildContext) -> KernelDatapath:
    from usproxy.offload.iptables.datapath import IptablesDatapath

    s = ctx.settings
    return IptablesDatapath(netns=ctx.netns, node=ctx.node, lb_policy=s.lb_policy, clusterip_interface=s.vip_interface,
                            node_ips=ctx.node_ips, localhost_nodeports=s.iptables_localhost_nodeports,
                            hairpin_mark=s.hairpin_mark)


def probe_iptables() -> Capability:
    """The agent's own probe (IptablesDatapath.probe: the node's backend takes every match and
    target of the rules), so `usproxy check` and the agent cannot disagree."""
    from usproxy.offload.iptables.datapath import IptablesDatapath

    dp = IptablesDatapath()
    try:
        return dp.probe()
    finally:
        dp.close()


def probes(cfg: ProxyConfig) -> list[Capability]:
    return [probe_iptables()]


async def leftovers(cfg: ProxyConfig) -> list[str]:
    """This mode's KUBE-* chains in either backend and family (changing nothing)."""
    from usproxy.offload.iptables.datapath import IptablesDatapath

    dp = IptablesDatapath()
    try:
        return await dp.leftovers()
    finally:
        dp.close()


async def remove(cfg: ProxyConfig) -> None:
    """Delete this mode's jumps and chains from both backends, keeping every other program's
    rules (leftovers.py), as kube-proxy's CleanupLeftovers."""
    from usproxy.offload.iptables.datapath import IptablesDatapath

    dp = IptablesDatapath()
    try:
        await dp.cleanup()
    finally:
        dp.close()


DECLARATION = KernelDatapathDeclaration(
    name="iptables",
    summary="kube-proxy's iptables mode, the rules `usproxy explain --mode iptables` prints: this node's "
            "connections and forwarded ones, with iptables-nft or iptables-legacy",
    serves=ALL_TRAFFIC,
    # random: `statistic --mode random`. roundRobin: only as the agent's default, served as random
    # (as nftables serves it for unannotated ServicePorts); a ServicePort annotated roundRobin
    # stays with a datapath that keeps a counter (IptablesDatapath.unsupported says so).
    lb_policies=frozenset({"random", "roundRobin"}),
    build=build,
    probes=probes,
    leftovers=leftovers,
    remove=remove,
    optional=(UdpConntrackReconciler, KernelWriteCounter),
)
