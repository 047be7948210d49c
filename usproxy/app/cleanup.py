"""`usproxy run --cleanup`: remove everything usproxy installed in the kernel, then exit.

As kube-proxy's CleanupLeftovers (pkg/proxy/nftables/proxier.go): delete the usproxy nftables
tables of both families (absent tables are fine), the BPF datapath's programs and pins when
that datapath is present, and the ClusterIP interface (usproxy0) with its addresses. Returns the exit code: 0 when everything was removed, 1 otherwise.

remove_leftovers and remove_bpf_leftovers: at agent start, the nftables tables, or the BPF programs
and pins, of an earlier run when this run does not use that datapath (kube-proxy's platformCleanup,
cmd/kube-proxy/app/server_linux.go).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from pathlib import Path

from usproxy.model.config import ProxyConfig
from usproxy.offload.kernel_datapath import KernelDatapath

log = logging.getLogger(__name__)


async def remove_kernel_state(kernels: Sequence[KernelDatapath]) -> bool:
    """Remove what each kernel datapath installed, then release it; True when all succeeded
    (one failing does not stop the others)."""
    ok = True
    for k in kernels:
        try:
            await k.cleanup()
            log.info("removed what the %s datapath installed", k.name)
        except Exception as err:
            log.error("removing what the %s datapath installed: %s", k.name, err)
            ok = False
        finally:
            k.close()
    return ok


def _kernel_datapaths(cfg: ProxyConfig) -> list[KernelDatapath]:
    from usproxy.offload.nftables.datapath import NftablesDatapath

    out: list[KernelDatapath] = [NftablesDatapath()]
    try:
        from usproxy.offload.bpf.datapath import BpfDatapath
    except ImportError:
        return out
    return [*out, BpfDatapath(cfg.bpf_cgroup)]


async def _vip_interface(cfg: ProxyConfig) -> bool:
    from usproxy.relay.vip_interface import VipInterface

    vip = VipInterface(cfg.vip_interface)
    try:
        if await vip.delete():
            log.info("removed interface %s and its ClusterIPs", cfg.vip_interface)
        return True
    except Exception as err:
        log.error("removing interface %s: %s", cfg.vip_interface, err)
        return False
    finally:
        vip.worker.close()


async def _cleanup(cfg: ProxyConfig) -> int:
    ok = await remove_kernel_state(_kernel_datapaths(cfg))
    ok = await _vip_interface(cfg) and ok
    return 0 if ok else 1


def cleanup(cfg: ProxyConfig) -> int:
    """Remove usproxy's kernel state (nftables tables, BPF programs and pins). Exit code."""
    return asyncio.run(_cleanup(cfg))


async def remove_leftovers(used: Collection[str]) -> list[str]:
    """At agent start: remove the nftables tables when this run does not use the nftables
    datapath (`used`: the names of the kernel datapaths this run built, e.g. {"bpf"}; empty with
    --offload none), so an earlier run's tables (possibly stale endpoints) do not stay the
    datapath under the relay. As kube-proxy's platformCleanup (cmd/kube-proxy/app/
    server_linux.go), which at start runs the CleanupLeftovers of the modes it is not running.
    Tradeoff, as kube-proxy's mode switch: connections the removed tables were NATing end.
    Returns what was removed, e.g. ["nftables table ip usproxy"]; never raises (a failure is
    logged). Same-mode restarts are untouched: the datapaths in `used` adopt their state.
    BPF pins: remove_bpf_leftovers (their root is node-wide: the agent takes its lock first)."""
    if "nftables" in used:
        return []
    try:
        removed = await _nftables_leftovers()
    except Exception as err:
        log.error("removing nftables tables left by an earlier run: %s", err)
        return []
    for what in removed:
        log.warning("removed %s: left by an earlier run with another --offload (this run does not use nftables)",
                    what)
    return removed


async def _nftables_leftovers() -> list[str]:
    """Delete the usproxy tables of both families if any exists; the tables that existed."""
    from usproxy.offload.nftables.datapath import NftablesDatapath
    from usproxy.offload.nftables.names import FAMILIES, TABLE, nft_family

    dp = NftablesDatapath()
    try:
        present = [f"nftables table {nft_family(f)} {TABLE}" for f in FAMILIES
                   if await dp.transport.list_table(nft_family(f), TABLE) is not None]
        if present:
            await dp.cleanup()
        return present
    finally:
        dp.close()


async def remove_bpf_leftovers(cgroup: Path, root: Path) -> list[str]:
    """At the start of an agent without `--offload bpf`: detach the programs an earlier BPF run
    pinned under `root` (socket LB on `cgroup`, tc, XDP) and remove its pins, as remove_leftovers
    does for nftables: otherwise the socket LB would go on translating ClusterIPs to that run's
    endpoints ahead of this run's datapath. The caller holds `root`'s lock (pin_root.PinsLock).
    Returns what was removed (["BPF programs and pins under <root>"] or []); never raises."""
    try:
        from usproxy.offload.bpf.datapath import BpfDatapath
    except Exception as err:  # no libbpf here: nothing this host could have pinned with it either
        log.error("removing BPF pins under %s left by an earlier run: %s", root, err)
        return []
    dp = BpfDatapath(cgroup, root)
    try:
        await dp.cleanup()
    except Exception as err:
        log.error("removing BPF pins under %s left by an earlier run: %s", root, err)
        return []
    what = f"BPF programs and pins under {root}"
    log.warning("removed %s: left by an earlier run with another --offload (this run does not use bpf)", what)
    return [what]
