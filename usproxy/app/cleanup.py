"""Removing kernel state: `usproxy run --cleanup`, and an earlier run's leftovers at agent start.

`cleanup`: as kube-proxy's CleanupLeftovers for every mode, remove what every declared kernel
datapath (usproxy/offload/registry.py) ever installed, then the ClusterIP interface (usproxy0)
with its addresses and the relay's blackhole routes of the Service CIDRs
(usproxy/relay/service_cidr_routes.py), the relay's capture rules (table usproxy-capture,
or its iptables chains: usproxy/relay/port_capture.py), and the routing of answers to local
sources from the network (table usproxy-return and its policy rules, `local` back at priority 0:
usproxy/relay/return_route.py); exit code 0 when everything was removed, 1 otherwise (one
failing does not stop the others).

`remove_leftovers`: at agent start, what an earlier run left of the kernel datapaths this run
does not use (kube-proxy's platformCleanup, cmd/kube-proxy/app/server_linux.go, which at start
runs the CleanupLeftovers of the modes it is not running): otherwise an earlier run's tables or
socket LB would stay the datapath under the relay with stale endpoints. Tradeoff, as kube-proxy's
mode switch: connections they were translating end. Datapaths this run uses adopt their state
(C20). A datapath that declares a lock (BPF: the node-wide pin root) is cleaned only under it;
when a running agent holds it, its state is that agent's and stays.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

from usproxy.model.config import ProxyConfig
from usproxy.offload import registry
from usproxy.offload.kernel_datapath import KernelDatapathDeclaration
from usproxy.util.errors import AlreadyRunning

log = logging.getLogger(__name__)


async def remove_kernel_state(cfg: ProxyConfig,
                              declared: Sequence[KernelDatapathDeclaration] = registry.KERNEL_DATAPATHS) -> bool:
    """Remove what each kernel datapath `declared` installed; True when all succeeded."""
    ok = True
    for d in declared:
        try:
            await d.remove(cfg)
            log.info("%s datapath: removed whatever of it was installed (nothing, if it never ran)", d.name)
        except Exception as err:
            log.error("removing what the %s datapath installed: %s", d.name, err)
            ok = False
    return ok


async def _vip_interface(cfg: ProxyConfig) -> bool:
    from usproxy.relay.vip_interface import VipInterface

    from usproxy.relay import service_cidr_routes

    vip = VipInterface(cfg.vip_interface)
    try:
        if await vip.delete():
            log.info("removed interface %s and its ClusterIPs", cfg.vip_interface)
        if await vip.worker.call(lambda ipr: service_cidr_routes.reconcile(ipr, ())):
            log.info("removed the routes that drop unallocated Service CIDR addresses")
        return True
    except Exception as err:
        log.error("removing interface %s: %s", cfg.vip_interface, err)
        return False
    finally:
        vip.worker.close()


async def _relay_capture() -> bool:
    """The relay's capture rules (usproxy/relay/port_capture.py), of either mechanism."""
    from usproxy.relay.port_capture import PortCapture

    try:
        await PortCapture().cleanup()
        return True
    except Exception as err:
        log.error("removing the relay's capture rules: %s", err)
        return False


async def _return_route() -> bool:
    """Table usproxy-return and usproxy's policy rules (usproxy/relay/return_route.py)."""
    from usproxy.relay import return_route
    from usproxy.util.netlink_worker import NetlinkWorker

    worker = NetlinkWorker()
    try:
        why, done = await return_route.remove(worker)
    finally:
        worker.close()
    if why:
        log.error("removing the routing of answers to local sources: %s", why)
        return False
    if done:
        log.info("removed the policy rules that route answers to local sources out: %s", " ".join(done))
    return True


async def _cleanup(cfg: ProxyConfig) -> int:
    ok = await remove_kernel_state(cfg)
    ok = await _relay_capture() and ok
    ok = await _return_route() and ok
    ok = await _vip_interface(cfg) and ok
    return 0 if ok else 1


def cleanup(cfg: ProxyConfig) -> int:
    """Remove usproxy's kernel state (every kernel datapath's, and usproxy0). Exit code."""
    return asyncio.run(_cleanup(cfg))


async def remove_leftovers(cfg: ProxyConfig, used: Collection[str]) -> list[str]:
    """At agent start: remove what an earlier run left of every kernel datapath not in `used`
    (the names this run built; empty with --offload none). The caller holds this network
    namespace's offload lock. Returns what was removed, e.g. ["nftables table ip usproxy"];
    never raises (a failure is logged)."""
    removed: list[str] = []
    for d in registry.unused(used):
        removed += await _leftovers_of(d, cfg)
    return removed


async def _leftovers_of(d: KernelDatapathDeclaration, cfg: ProxyConfig) -> list[str]:
    try:
        found = await d.leftovers(cfg)
    except Exception as err:
        log.error("looking for %s state left by an earlier run: %s", d.name, err)
        return []
    if not found:
        return []
    lock = d.lock(cfg) if d.lock is not None else None
    try:
        if lock is not None:
            lock.acquire()
    except AlreadyRunning as err:
        log.info("kept the %s: %s", ", ".join(found), err)
        return []
    try:
        await d.remove(cfg)
    except Exception as err:
        log.error("removing %s left by an earlier run: %s", ", ".join(found), err)
        return []
    finally:
        if lock is not None:
            lock.release()
    for what in found:
        log.warning("removed %s: left by an earlier run with another --offload (this run does not use %s)",
                    what, d.name)
    return found
