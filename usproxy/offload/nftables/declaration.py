"""The nftables datapath as the registry declares it (usproxy/offload/registry.py).

Light to import: libnftables and the datapath load only when one of these functions runs. Its
state is per network namespace (`ip usproxy` and `ip6 usproxy`), so the agent's network
namespace offload lock covers it and no further lock is declared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usproxy.util.errors import OffloadError
from usproxy.core.datapath import KernelWriteCounter, ServiceCIDRHandler, UdpConntrackReconciler
from usproxy.offload.kernel_datapath import ALL_TRAFFIC, BuildContext, Capability, KernelDatapath, KernelDatapathDeclaration

if TYPE_CHECKING:
    from usproxy.model.config import ProxyConfig
    from usproxy.offload.nftables.datapath import NftTransport


def build(ctx: BuildContext) -> KernelDatapath:
    from usproxy.offload.nftables.datapath import NftablesDatapath

    s = ctx.settings
    return NftablesDatapath(netns=ctx.netns, lb_policy=s.lb_policy, node=ctx.node, service_cidrs=s.service_cidrs,
                            clusterip_interface=s.vip_interface, node_ips=ctx.node_ips)


def probe_nftables(transport: NftTransport | None = None) -> Capability:
    """The agent's own probe (datapath.probe_capability) through `transport` (default:
    libnftables in this network namespace), so `usproxy check` and the agent cannot disagree."""
    from usproxy.offload.nftables.client import NftClient
    from usproxy.offload.nftables.datapath import probe_capability

    client = transport if transport is not None else NftClient()
    try:
        return probe_capability(client)
    finally:
        client.close()


def probes(cfg: ProxyConfig) -> list[Capability]:
    return [probe_nftables()]


async def leftovers(cfg: ProxyConfig) -> list[str]:
    """The usproxy tables of either family that exist in this network namespace; none on a
    kernel without nf_tables (the listing fails there and the probe says so: nothing can have
    been left)."""
    from usproxy.offload.nftables.datapath import NftablesDatapath
    from usproxy.model.types import FAMILIES
    from usproxy.offload.nftables.names import TABLE, nft_family

    dp = NftablesDatapath()
    try:
        return [f"nftables table {nft_family(f)} {TABLE}" for f in FAMILIES
                if await dp.transport.list_table(nft_family(f), TABLE) is not None]
    except OffloadError:
        if not probe_nftables().available:
            return []
        raise
    finally:
        dp.close()


async def remove(cfg: ProxyConfig) -> None:
    """Delete both families' tables (absent ones are fine), as kube-proxy's CleanupLeftovers."""
    from usproxy.offload.nftables.datapath import NftablesDatapath

    dp = NftablesDatapath()
    try:
        await dp.cleanup()
    finally:
        dp.close()


DECLARATION = KernelDatapathDeclaration(
    name="nftables",
    summary="kube-proxy's nftables mode, with maps per endpoint count: this node's connections and forwarded ones",
    serves=ALL_TRAFFIC,
    # random: `numgen random`; roundRobin: `numgen inc` (an annotated ServicePort gets chains of
    # its own; the agent's default is served as random). leastConnections needs per-endpoint
    # connection counts the kernel does not keep.
    lb_policies=frozenset({"random", "roundRobin"}),
    build=build,
    probes=probes,
    leftovers=leftovers,
    remove=remove,
    optional=(ServiceCIDRHandler, UdpConntrackReconciler, KernelWriteCounter),
)
