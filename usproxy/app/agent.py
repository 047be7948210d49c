"""Agent: wires a source, the Proxier, its datapaths and the admin server, and runs them.

Wiring only: the datapaths come from the relay and the kernel datapath registry
(usproxy/offload/registry.py), the rows of /services and /flows from usproxy/admin/views.py,
the removal of an earlier run's kernel state from usproxy/app/cleanup.py.

Life: this node's facts are resolved once (NodeFacts: the same node name for the Proxier, every
datapath and the source; with detectLocalMode NodeCIDR `node_facts` first waits for the Node's
pod CIDRs, as kube-proxy waits before it builds its proxier), each datapath gets its own
settings from the ProxyConfig, the source lists (a manifest that cannot be parsed at start raises ConfigError: exit 2), the admin server
binds, the service health server (healthCheckNodePorts) is handed to the Proxier, the
SyncRunner, the source's watch and the watch of the NodePort addresses (a change makes the next
sync a full one) run as guarded tasks, and SIGTERM or SIGINT stops everything in reverse order,
releasing what the datapaths installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from usproxy.admin.health import Health, evaluate
from usproxy.admin.server import AdminServer
from usproxy.admin.service_health import ServiceHealthServer
from usproxy.admin.views import AgentViews
from usproxy.core.datapath import Datapath, NodeAddressFollower, ServiceCIDRHandler, ServicePortState
from usproxy.core.events import EventHub
from usproxy.core.proxier import Proxier
from usproxy.model.config import ProxyConfig
from usproxy.model.node import NodeFacts, PodCIDRsChanged, node_name, resolve_node, watch_nodeport_addresses
from usproxy.model.types import NamespacedName, format_hostport
from usproxy.offload import registry
from usproxy.sources import NodeEligibility, Source
from usproxy.util.errors import AlreadyRunning, ConfigError
from usproxy.util.locks import NetnsLock
from usproxy.util.metrics import Metrics
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.util.rows import FlowRow, ServiceRow

if TYPE_CHECKING:
    from usproxy.offload.manager import OffloadManager
    from usproxy.sources.parse_helper import Prefetch

log = logging.getLogger(__name__)

# Kernel datapaths beside which the hairpin table (relay/return_route.py) stays out: its `ct`
# rules turn conntrack on in the node's netns, and with it on (found 2026-12-05, not fixed)
# - bpf: br_netfilter defragments a pod's UDP answer before the tc programs see it, and it is
#   lost (tests/cluster/test_tc_fragments.py failed in SNAT and DSR mode);
# - ipvs: a relayed UDP session lost a datagram at the offload to IPVS, or moved to another
#   endpoint (the VM lab's ipvs scenario failed in all 7 runs with a `ct` rule in the table, 3 of
#   them with the whole table; one `ct state new` rule alone does it; without, it passed 3 of 3).
NO_HAIRPIN_TABLE_BESIDE = frozenset({"bpf", "ipvs"})


def build_datapaths(cfg: ProxyConfig, node: NodeFacts, metrics: Metrics,
                    request_sync: Callable[[], None], events: EventHub | None = None) -> list[Datapath]:
    """The relay always; the offload manager over the kernel datapaths `--offload` allows
    (registry.build) on top. `request_sync` is how the offload manager asks for a sync when a
    window ends; `events` where it publishes offloads and demotions."""
    from usproxy.relay.relay import Relay, RelaySettings

    relay = Relay(RelaySettings.from_config(cfg), node, metrics)
    relay.return_mark = cfg.hairpin_mark  # hairpinned LB IP sources answered out (relay/return_route.py)
    if not registry.allowed(cfg.offload):
        return [relay]
    from usproxy.offload.kernel_datapath import BuildContext
    from usproxy.offload.manager import OffloadManager
    from usproxy.offload.settings import OffloadSettings

    settings = OffloadSettings.from_config(cfg)
    # the node's addresses now, for loadBalancerSourceRanges: the relay's (synced first)
    ctx = BuildContext(settings, node, node_ips=lambda: [ipaddress.ip_address(a) for a in relay.node_ips])
    kernels = registry.build(ctx)
    if cfg.hairpin_mark and (beside := [k.name for k in kernels if k.name in NO_HAIRPIN_TABLE_BESIDE]):
        log.info("hairpinned LB IP sources are not routed back out beside the %s datapath (its table "
                 "tracks connections, which %s does not survive)", beside[0], beside[0])
        relay.return_mark = 0
    # unallocated Service CIDR addresses: a kernel datapath that checks the CIDRs drops them (nftables'
    # cluster-ips-check, as kube-proxy's); without one the relay blackholes them
    relay.drop_unallocated = not any(isinstance(k, ServiceCIDRHandler) for k in kernels)
    manager = OffloadManager(settings, kernels, request_sync=request_sync, metrics=metrics, events=events)
    relay.kernel_serves = manager.serves_at_once  # listeners of what the kernel serves at once open after the sync
    return [relay, manager]


def uses_api_server(cfg: ProxyConfig) -> bool:
    """Whether the agent's source is the Kubernetes API (else a static manifest, or an error)."""
    return cfg.services is None and (cfg.kubeconfig is not None or _in_cluster())


async def node_facts(cfg: ProxyConfig) -> NodeFacts:
    """This node's facts (resolve_node). With detectLocalMode NodeCIDR, first this Node's
    spec.podCIDRs: from the API server, waiting until it has some (sources/kube.wait_for_pod_cidrs:
    at most 5 minutes, then SourceError, as kube-proxy), or from the Node object of the static
    manifests (sources/static.static_pod_cidrs: ConfigError when missing)."""
    kubernetes = uses_api_server(cfg)
    if cfg.detect_local_mode != "NodeCIDR":
        return resolve_node(cfg, kubernetes=kubernetes)
    name = node_name(cfg, kubernetes=kubernetes)[0]
    if cfg.services is not None:
        from usproxy.sources.static import static_pod_cidrs

        cidrs = await asyncio.to_thread(static_pod_cidrs, cfg.services, name)
    elif kubernetes:
        from usproxy.sources.kube import wait_for_pod_cidrs

        assert name is not None  # node_name names the node whenever the API is the source
        cidrs = await wait_for_pod_cidrs(cfg, name)
    else:
        raise ConfigError("give --services PATH or --kubeconfig PATH", obj="usproxy run")
    return resolve_node(cfg, kubernetes=kubernetes, pod_cidrs=cidrs)


class Agent:
    """One running usproxy agent. `node`: this node's facts when the caller resolved them
    (node_facts(), needed for detectLocalMode NodeCIDR), else resolved here."""

    def __init__(self, cfg: ProxyConfig, datapaths: list[Datapath] | None = None, *,
                 node: NodeFacts | None = None, prefetch: Prefetch | None = None) -> None:
        self.cfg = cfg
        self.prefetch = prefetch  # the static manifests, read (and partly parsed) at start
        # Real datapaths: one agent per ClusterIP interface, and one offloading agent (the
        # kernel tables are per namespace), in this network namespace; a kernel datapath's own
        # lock (BPF: one agent per pin root, bpffs is node-wide) is taken in start().
        self._locks = [] if datapaths is not None else [NetnsLock(cfg.vip_interface)] + (
            [NetnsLock("offload")] if registry.allowed(cfg.offload) else [])
        self._real = datapaths is None
        self.metrics = Metrics()
        self.events = EventHub()
        self.node = node or resolve_node(cfg, kubernetes=uses_api_server(cfg))
        self.datapaths = datapaths if datapaths is not None else build_datapaths(
            cfg, self.node, self.metrics, self._datapath_wants_sync, self.events)
        self.proxier = Proxier(self.datapaths, node=self.node, metrics=self.metrics,
                               min_sync_period=cfg.min_sync_period, sync_period=cfg.sync_period)
        self.admin = AdminServer(self, cfg.healthz_bind_address, cfg.metrics_bind_address)
        self.service_health = ServiceHealthServer(self.node, lambda: self.health().healthy,
                                                  exclude_interface=cfg.vip_interface)
        self.proxier.service_health = self.service_health
        self.views = AgentViews(self.proxier, self.datapaths, self.service_health,
                                cfg.bpf_lb_mode if cfg.offload == "bpf" else None)
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self.source: Source | None = None
        self.exit_code = 0

    def _datapath_wants_sync(self) -> None:
        """Called by a datapath (never before the Proxier exists: only a sync arms it)."""
        self.proxier.request_sync()

    # -- AdminView ----------------------------------------------------------------------------
    def health(self) -> Health:
        runner = self.proxier.runner
        h = evaluate(self.proxier.last_updated, self.proxier.oldest_queued, 2 * self.cfg.sync_period,
                     error=runner.last_error, failing_since=runner.failing_since)
        eligible = self.source.node_eligible if isinstance(self.source, NodeEligibility) else True
        return dataclasses.replace(h, node_eligible=eligible)

    async def services(self) -> list[ServiceRow]:
        return await self.views.services()

    async def flows(self) -> list[FlowRow]:
        return await self.views.flows()

    def service_ports(self, service: NamespacedName | None = None) -> list[ServicePortState]:
        return self.views.service_ports(service)

    def last_sync(self) -> float | None:
        """When the Proxier last synced (None: not yet): the web view re-reads the kernel's
        tables after each sync."""
        return self.proxier.last_updated

    def kernel_datapaths(self) -> tuple[str, ...]:
        """The names of the kernel datapaths this agent runs now ("nftables", "bpf"): the web
        view reads usproxy's nftables table from the kernel only where there is one."""
        manager = self.offload_manager()
        return tuple(k.name for k in manager.kernels) if manager is not None else ()

    @property
    def tour_results(self) -> Path | None:
        """The tour's results directory whose plots the web view shows (--tour-results)."""
        return self.cfg.tour_results

    def offload_manager(self) -> OffloadManager | None:
        """The offload manager over the kernel datapaths, if this agent offloads."""
        if not registry.allowed(self.cfg.offload):
            return None
        from usproxy.offload.manager import OffloadManager

        return next((d for d in self.datapaths if isinstance(d, OffloadManager)), None)

    # -- running ------------------------------------------------------------------------------
    def _guard(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except ConfigError as err:
                log.error("%s; stopping the agent", err)
                self.exit_code = 2
                self._stop.set()
            except PodCIDRsChanged as err:  # as kube-proxy: exit, to be restarted with the new ones
                log.error("%s", err)
                self.exit_code = 1
                self._stop.set()
            except Exception:
                log.exception("task %s ended unexpectedly; stopping the agent", name)
                self.exit_code = 1
                self._stop.set()
        self._tasks.append(asyncio.create_task(guarded(), name=name))

    def stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        """List the source, bind admin, start tasks. Raises ConfigError on unparsable input."""
        asyncio.get_running_loop().set_exception_handler(_loop_exception_handler)
        for lock in self._locks:
            await lock.acquire_within(lock.wait)
        if self._real:
            await self._take_kernel_locks()
        source = self.source = self._make_source()
        if self._real and not self._kernel_names():  # no kernel datapath: clear the rest now
            await self._remove_leftovers()
        elif self._real:
            self._guard("leftovers", self._remove_leftovers_after_first_sync())
        await self.admin.start()
        for role, addr in self.admin.bound.items():
            log.info("serving %s on %s", role, format_hostport(addr[0], addr[1]))
        self._guard("sync-runner", self.proxier.runner.loop())
        self._guard("source", source.run())
        if self._real:  # real datapaths: they follow this node's NodePort addresses
            self._guard("nodeport-addresses", watch_nodeport_addresses(
                self.node, self.cfg.vip_interface, self._nodeport_addresses_changed))

    async def _take_kernel_locks(self) -> None:
        """Take the lock each built kernel datapath declares (BPF: its node-wide pin root). Held
        by a running agent: asked for by name (`--offload bpf`) that is AlreadyRunning (exit 1);
        under `auto` that datapath leaves the ladder, with the reason in its placements."""
        manager = self.offload_manager()
        if manager is None:
            return
        for k in list(manager.kernels):
            declaration = registry.BY_NAME.get(k.name)
            if declaration is None or declaration.lock is None:
                continue
            lock = declaration.lock(self.cfg)
            try:
                await lock.acquire_within(lock.wait)
            except AlreadyRunning as err:
                if self.cfg.offload == k.name:
                    raise
                log.warning("%s datapath left out: %s", k.name, err)
                manager.leave_out(k.name, str(err))
                continue
            self._locks.append(lock)

    async def _remove_leftovers_after_first_sync(self) -> None:
        """With kernel offload, an earlier run's other datapath goes only once this run's first
        sync has installed its own: the kernel tracks connections in a network namespace only
        while some rule there uses conntrack, so removing the old rules first would leave the
        flows they translated without their NAT until the new datapath's first read back (seen:
        every connection DNATed by iptables reset when an --offload nftables agent started)."""
        while self.proxier.last_updated is None:
            await asyncio.sleep(0.05)
        await self._remove_leftovers()

    async def _remove_leftovers(self) -> None:
        """Remove an earlier run's kernel state of the datapaths this run does not use
        (cleanup.remove_leftovers, as kube-proxy's platformCleanup), holding this netns's offload
        lock: with --offload none it is taken just for this, and when another agent holds it
        (it offloads here: the tables are its own) nothing is removed."""
        from usproxy.app.cleanup import remove_leftovers

        lock = None if registry.allowed(self.cfg.offload) else NetnsLock("offload")
        try:
            if lock is not None:
                lock.acquire()
        except AlreadyRunning as err:
            log.info("kept the kernel tables of this network namespace: %s", err)
            return
        try:
            await remove_leftovers(self.cfg, self._kernel_names())
        finally:
            if lock is not None:
                lock.release()

    async def _nodeport_addresses_changed(self) -> None:
        """The NodePort addresses changed: the kernel datapaths that read them themselves read
        them again (NodeAddressFollower), then every datapath gets a full sync (the relay's
        listeners, nftables' nodeport-ips)."""
        manager = self.offload_manager()
        for k in manager.kernels if manager is not None else ():
            if isinstance(k, NodeAddressFollower):
                await k.node_addresses_changed()
        self.proxier.request_full_sync()

    def _kernel_names(self) -> frozenset[str]:
        """The kernel datapaths this run built (empty with --offload none)."""
        manager = self.offload_manager()
        return frozenset(k.name for k in manager.kernels) if manager is not None else frozenset()

    def _make_source(self) -> Source:
        if self.cfg.services is not None:
            from usproxy.sources.static import StaticSource, watch_sighup

            src = StaticSource(self.cfg.services, self.proxier, node=self.node,
                               on_error=lambda e: self.metrics.config_errors.labels("manifest").inc())
            src.load_initial(self.prefetch)
            self.prefetch = None
            watch_sighup(src)
            return src
        if uses_api_server(self.cfg):
            from usproxy.sources.kube import KubeSource

            assert self.node.name is not None  # resolve_node names the node whenever the API is the source
            return KubeSource(self.cfg, self.proxier, self.metrics, node_name=self.node.name,
                              pod_cidrs=self.node.pod_cidrs)
        raise ConfigError("give --services PATH or --kubeconfig PATH", obj="usproxy run")

    async def run(self) -> None:
        """Start, wait for SIGTERM/SIGINT or stop(), shut down."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.proxier.close()
        await self.service_health.close()
        await self.admin.stop()
        for lock in self._locks:
            lock.release()


_limited = RateLimitedLog(log)
def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Errors the loop reports (e.g. accept() failing with EMFILE, after which asyncio backs off
    and retries by itself) are logged at a bounded rate instead of once per event."""
    exc = context.get("exception")
    _limited.warning("event loop: %s%s", context.get("message", "error"), f": {exc!r}" if exc else "")


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
