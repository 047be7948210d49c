"""`usproxy run --cleanup`: remove everything usproxy installed in the kernel, then exit.

As kube-proxy's CleanupLeftovers (pkg/proxy/nftables/proxier.go): delete the usproxy nftables
tables of both families (absent tables are fine), the BPF datapath's programs and pins when
that datapath is present, and the ClusterIP interface (usproxy0) with its addresses. Returns the exit code: 0 when everything was removed, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from usproxy.config import ProxyConfig
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
