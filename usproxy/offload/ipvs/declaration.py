"""The IPVS datapath as the registry declares it (usproxy/offload/registry.py).

Light to import: pyroute2's IPVS and the datapath load only when one of these functions runs. Its
state is per network namespace (IPVS, kube-ipvs0, ipsets and iptables rules are all per
namespace), so the agent's network namespace offload lock covers it. It sits between nftables and
iptables on the ladder, as kube-proxy's modes rank: where nf_tables is missing it serves before
iptables. It and the iptables datapath write chains of the same names (kube-proxy runs one mode per
node), so one agent uses at most one of them: `conflicts`.

Scheduler per LB policy (rules.SCHEDULERS): roundRobin rr (kube-proxy's default), leastConnections
lc. IPVS has no random scheduler: a ServicePort that asks for random stays with a datapath that
has one.

Probing does not load ip_vs: the agent under `--offload auto` uses IPVS only where the module is
loaded already (`usproxy check` says so); `--offload ipvs` asks for it, and its first use loads
the module as kube-proxy's IPVS mode does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usproxy.offload.kernel_datapath import ALL_TRAFFIC, BuildContext, Capability, KernelDatapath, KernelDatapathDeclaration

if TYPE_CHECKING:
    from usproxy.model.config import ProxyConfig


def build(ctx: BuildContext) -> KernelDatapath:
    from usproxy.offload.ipvs.datapath import IpvsDatapath

    s = ctx.settings
    return IpvsDatapath(netns=ctx.netns, node=ctx.node, lb_policy=s.lb_policy, clusterip_interface=s.vip_interface,
                        node_ips=ctx.node_ips, load_module=s.mode == "ipvs")


def probe_ipvs(load_module: bool = False) -> Capability:
    """The agent's own probe (IpvsDatapath.probe), so `usproxy check` and the agent agree."""
    from usproxy.offload.ipvs.datapath import IpvsDatapath

    dp = IpvsDatapath(load_module=load_module)
    try:
        return dp.probe()
    finally:
        dp.close()


def probes(cfg: ProxyConfig) -> list[Capability]:
    return [probe_ipvs(cfg.offload == "ipvs")]


async def leftovers(cfg: ProxyConfig) -> list[str]:
    """This mode's virtual servers (those usproxy's set names), kube-ipvs0, sets and chains; at
    an agent's start, without the virtual servers remove() keeps (those carrying connections)."""
    from usproxy.offload.ipvs.datapath import IpvsDatapath

    dp = IpvsDatapath()
    try:
        return await dp.leftovers(keep_busy=not cfg.cleanup)
    finally:
        dp.close()


async def remove(cfg: ProxyConfig) -> None:
    """Delete all of it, keeping every other program's virtual servers and rules (leftovers.py);
    at an agent's start (not --cleanup) the virtual servers that carry connections stay."""
    from usproxy.offload.ipvs.datapath import IpvsDatapath

    dp = IpvsDatapath()
    try:
        await dp.cleanup(keep_busy=not cfg.cleanup)
    finally:
        dp.close()


DECLARATION = KernelDatapathDeclaration(
    name="ipvs",
    summary="kube-proxy's IPVS mode, what `usproxy explain --mode ipvs` prints: virtual servers, kube-ipvs0, "
            "ipsets and its iptables rules; this node's connections and forwarded ones",
    serves=ALL_TRAFFIC,
    lb_policies=frozenset({"roundRobin", "leastConnections"}),
    build=build,
    probes=probes,
    leftovers=leftovers,
    remove=remove,
    conflicts=("iptables",),
)
