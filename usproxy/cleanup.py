"""`usproxy run --cleanup`: remove everything usproxy installed in the kernel, then exit.

As kube-proxy's CleanupLeftovers (pkg/proxy/nftables/proxier.go): delete the usproxy nftables
tables of both families (absent tables are fine), the BPF datapath's programs and pins when
that datapath is present, and the ClusterIP interface (usproxy0) with its addresses. Returns the exit code: 0 when everything was removed, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import logging

from usproxy.config import ProxyConfig

log = logging.getLogger(__name__)


async def _nftables() -> bool:
    from usproxy.offload.nftables.datapath import NftablesDatapath

    dp = NftablesDatapath()
    try:
        await dp.cleanup()
        log.info("removed nftables tables ip/ip6 usproxy")
        return True
    except Exception as err:
        log.error("removing the usproxy nftables tables: %s", err)
        return False
    finally:
        dp.close()


async def _bpf(cfg: ProxyConfig) -> bool:
    try:
        from usproxy.offload.bpf.datapath import BpfDatapath
    except ImportError:
        return True
    try:
        await BpfDatapath(cfg.bpf_cgroup).cleanup()
        return True
    except Exception as err:
        log.error("removing the BPF datapath: %s", err)
        return False


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
    ok = await _nftables()
    ok = await _bpf(cfg) and ok
    ok = await _vip_interface(cfg) and ok
    return 0 if ok else 1


def cleanup(cfg: ProxyConfig) -> int:
    """Remove usproxy's kernel state (nftables tables, BPF programs and pins). Exit code."""
    return asyncio.run(_cleanup(cfg))
