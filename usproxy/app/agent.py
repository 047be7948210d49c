"""Agent: wires a source, the Proxier, its datapaths and the admin server, and runs them.

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
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, runtime_checkable

from usproxy.core.events import EventHub
from usproxy.admin.health import Health, evaluate
from usproxy.util.metrics import Metrics
from usproxy.admin.server import AdminServer
from usproxy.admin.service_health import ServiceHealthServer
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import Datapath, FlowsView, Placement, ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import AlreadyRunning, ConfigError
from usproxy.model.node import NodeFacts, PodCIDRsChanged, node_name, resolve_node, watch_nodeport_addresses
from usproxy.offload import external_route
from usproxy.offload.external_route import ExternalView
from usproxy.offload.pin_root import PinsLock, default_pin_root, has_pins
from usproxy.core.proxier import Proxier
from usproxy.util.locks import NetnsLock
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.sources import NodeEligibility, Source
from usproxy.model.types import NamespacedName, ServicePortName, format_hostport

log = logging.getLogger(__name__)

VIEW_CHUNK = 250  # rows of /services and /flows built between two turns of the loop (~1-2 ms)
SERVICE_ROW_WORK = 4  # a ServicePort's own row costs about as much as 4 endpoint rows


@runtime_checkable
class ChunkedFlowsView(Protocol):
    """A datapath whose flows live on the loop and can be listed a chunk at a time (the relay):
    `flows_chunks(n)` yields lists of at most n /flows rows from a snapshot of its table."""

    def flows_chunks(self, size: int) -> Iterator[list[dict[str, Any]]]: ...


def build_datapaths(cfg: ProxyConfig, node: NodeFacts, metrics: Metrics,
                    request_sync: Callable[[], None], events: EventHub | None = None) -> list[Datapath]:
    """The relay always; kernel offload layers on top when allowed and available.
    `request_sync` is how the offload manager asks for a sync when a window ends; `events`
    where it publishes offloads and demotions."""
    from usproxy.relay.relay import Relay, RelaySettings

    relay = Relay(RelaySettings.from_config(cfg), node, metrics)
    if cfg.offload == "none":
        return [relay]
    from usproxy.offload.manager import OffloadManager, OffloadSettings, kernel_datapaths

    from usproxy.offload.nftables.datapath import NftablesDatapath

    settings = OffloadSettings.from_config(cfg)
    kernels = kernel_datapaths(settings, node)
    for k in kernels:  # the node's addresses, for loadBalancerSourceRanges (synced after the relay)
        if isinstance(k, NftablesDatapath):
            k.node_ips = lambda: [ipaddress.ip_address(a) for a in relay.node_ips]
    return [relay, OffloadManager(settings, kernels, request_sync=request_sync, metrics=metrics, events=events)]


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
                 node: NodeFacts | None = None) -> None:
        self.cfg = cfg
        # Real datapaths: one agent per ClusterIP interface, and one offloading agent (the
        # kernel tables are per namespace), in this network namespace; one BPF agent per pin root
        # (bpffs is node-wide).
        self._locks = [] if datapaths is not None else [NetnsLock(cfg.vip_interface)] + (
            [NetnsLock("offload")] if cfg.offload != "none" else []) + (
            [PinsLock(default_pin_root())] if cfg.offload == "bpf" else [])  # pins are node-wide
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
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self.source: Source | None = None
        self.exit_code = 0

    def _datapath_wants_sync(self) -> None:
        """Called by a datapath (never before the Proxier exists: only a sync arms it)."""
        self.proxier.request_sync()

    # -- AdminView ----------------------------------------------------------------------------
    def health(self) -> Health:
        h = evaluate(self.proxier.last_updated, self.proxier.oldest_queued, 2 * self.cfg.sync_period)
        eligible = self.source.node_eligible if isinstance(self.source, NodeEligibility) else True
        return dataclasses.replace(h, node_eligible=eligible)

    def services_view(self) -> list[dict[str, Any]]:
        """/services rows, one per ServicePort, sorted. Linear in endpoints: whether an endpoint
        is usable is a set lookup (a tuple scan made 10,000 endpoints cost 8.8 s on the loop).
        In one piece: the admin server awaits `services()`, which yields to the loop."""
        out = []
        external = self._external_view()
        for spn in sorted(self.proxier.service_map):
            st = self.proxier.state_of(spn)
            if st is not None:
                usable = set(st.cluster_endpoints)
                out.append(self._service_row(spn, st, [_endpoint_row(ep, usable) for ep in st.endpoints], external))
        return out

    async def services(self) -> list[dict[str, Any]]:
        """The rows of `services_view()`, built in chunks of about VIEW_CHUNK items (ServicePorts
        and endpoints) with the loop running between chunks, so a view of 100,000 endpoints does
        not stall the relay. Each row is one ServicePort's state when its turn came. The list
        and its rows are new, held by nothing else (usproxy.admin.snapshot encodes and frees
        them in a worker thread)."""
        out: list[dict[str, Any]] = []
        work = 0
        external = self._external_view()
        for spn in sorted(self.proxier.service_map):
            st = self.proxier.state_of(spn)
            if st is None:
                continue
            usable = set(st.cluster_endpoints)
            eps = []
            for ep in st.endpoints:
                eps.append(_endpoint_row(ep, usable))
                work += 1
                if work >= VIEW_CHUNK:
                    work = 0
                    await asyncio.sleep(0)
            out.append(self._service_row(spn, st, eps, external))
            work += SERVICE_ROW_WORK
        return out

    def _service_row(self, spn: ServicePortName, st: ServicePortState,
                     endpoints: list[dict[str, Any]], external: ExternalView | None) -> dict[str, Any]:
        sp = st.service_port
        where = self.proxier.placement(spn)
        ext = self._external(spn, st, external)
        return {
            "servicePortName": str(spn), "protocol": sp.protocol,
            "clusterIPs": [str(ip) for ip in sp.cluster_ips], "port": sp.port,
            "nodePort": sp.node_port, "type": sp.service_type,
            "externalIPs": [str(ip) for ip in sp.external_ips_all()],
            "sessionAffinity": sp.session_affinity, "affinityTimeoutSeconds": sp.affinity_timeout,
            "externalTrafficPolicy": sp.external_traffic_policy,
            "internalTrafficPolicy": sp.internal_traffic_policy,
            "endpoints": endpoints,
            "datapath": where.datapath, "reason": where.reason,
            "bpfLbMode": bpf_lb_mode(self.cfg, ext),
            "external": ext.datapath if ext else None, "externalReason": ext.reason if ext else "",
            "healthCheckNodePort": sp.health_check_node_port,
            "healthCheckError": self.service_health.error_of(spn.service),
        }

    def _external_view(self) -> ExternalView | None:
        """The datapath that tells external placements, looked up once per view: a runtime
        Protocol check per row was a fifth of /services' cost."""
        return next((dp for dp in self.datapaths if isinstance(dp, ExternalView)), None)

    def _external(self, spn: ServicePortName, st: ServicePortState, view: ExternalView | None) -> Placement | None:
        """Which datapath serves `spn` from outside the node (usproxy.offload.external_route)."""
        if view is not None:
            return view.external_placement(spn)
        return external_route.route(st, (), "no kernel datapath configured (--offload none)")

    def service_ports(self, service: NamespacedName | None = None) -> list[ServicePortState]:
        """Every ServicePort (of `service` only, when given) with its endpoints now, sorted by name
        (the web view's drawings). The state of each is computed, so names are filtered first:
        one Service's drawing never costs a pass over 5,000 Services' endpoints."""
        names = sorted(spn for spn in self.proxier.service_map
                       if service is None or (spn.namespace, spn.name) == service)
        states = (self.proxier.state_of(spn) for spn in names)
        return [st for st in states if st is not None]

    async def flows(self) -> list[dict[str, Any]]:
        """/flows: the relay's rows (read on the loop: its flow table lives there) and the kernel
        datapaths' rows, read in a worker thread: dumping kernel conntrack takes ~0.3 s per
        1,000 entries and must not stall the relay. The relay's rows are built VIEW_CHUNK at a
        time with the loop running between chunks (9,800 flows cost 0.15 s in one piece). The
        list and its rows are new, held by nothing else (as `services()`)."""
        out: list[dict[str, Any]] = []
        for dp in self.datapaths:
            if isinstance(dp, ChunkedFlowsView):
                for chunk in dp.flows_chunks(VIEW_CHUNK):
                    out.extend(chunk)
                    await asyncio.sleep(0)
            elif not isinstance(dp, FlowsView):
                continue
            elif dp.flows_block:
                out.extend(await asyncio.to_thread(dp.flows_view))
            else:
                out.extend(dp.flows_view())
        return out

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
        source = self.source = self._make_source()
        if self._locks:  # real datapaths, and their input parsed: clear what they will not use
            await self._remove_leftovers()
        await self.admin.start()
        for role, addr in self.admin.bound.items():
            log.info("serving %s on %s", role, format_hostport(addr[0], addr[1]))
        self._guard("sync-runner", self.proxier.runner.loop())
        self._guard("source", source.run())
        if self._locks:  # real datapaths: they follow this node's NodePort addresses
            self._guard("nodeport-addresses", watch_nodeport_addresses(
                self.node, self.cfg.vip_interface, self._nodeport_addresses_changed))

    async def _remove_leftovers(self) -> None:
        """Remove an earlier run's kernel state for the datapaths this run does not use
        (cleanup.remove_leftovers, as kube-proxy's platformCleanup), holding this netns's offload
        lock: with --offload none it is taken just for this, and when another agent holds it
        (it offloads here: the tables are its own) nothing is removed."""
        from usproxy.app.cleanup import remove_leftovers

        lock = NetnsLock("offload") if self.cfg.offload == "none" else None
        try:
            if lock is not None:
                lock.acquire()
        except AlreadyRunning as err:
            log.info("kept the kernel tables of this network namespace: %s", err)
            return
        try:
            await remove_leftovers(self._kernel_names())
        finally:
            if lock is not None:
                lock.release()
        if self.cfg.offload != "bpf":
            await self._remove_bpf_leftovers()

    async def _remove_bpf_leftovers(self) -> None:
        """Remove an earlier `--offload bpf` run's programs and pins (cleanup.remove_bpf_leftovers)
        when there are any, holding their pin root's lock: when a running agent holds it (another
        network namespace offloads to BPF with this pin root), nothing is removed."""
        root = default_pin_root()
        if not has_pins(root):
            return
        from usproxy.app.cleanup import remove_bpf_leftovers

        lock = PinsLock(root)
        try:
            lock.acquire()
        except AlreadyRunning as err:
            log.info("kept the BPF programs and pins under %s: %s", root, err)
            return
        try:
            await remove_bpf_leftovers(self.cfg.bpf_cgroup, root)
        finally:
            lock.release()

    async def _nodeport_addresses_changed(self) -> None:
        """The NodePort addresses changed: the kernel datapaths that read them themselves read
        them again (NodeAddressFollower), then every datapath gets a full sync (the relay's
        listeners, nftables' nodeport-ips)."""
        if self.cfg.offload != "none":
            from usproxy.offload.kernel_datapath import NodeAddressFollower
            from usproxy.offload.manager import OffloadManager

            for d in self.datapaths:
                for k in d.kernels if isinstance(d, OffloadManager) else ():
                    if isinstance(k, NodeAddressFollower):
                        await k.node_addresses_changed()
        self.proxier.request_full_sync()

    def _kernel_names(self) -> frozenset[str]:
        """The kernel datapaths this run built (empty with --offload none)."""
        if self.cfg.offload == "none":
            return frozenset()
        from usproxy.offload.manager import OffloadManager

        return frozenset(k.name for d in self.datapaths if isinstance(d, OffloadManager) for k in d.kernels)

    def _make_source(self) -> Source:
        if self.cfg.services is not None:
            from usproxy.sources.static import StaticSource, watch_sighup

            src = StaticSource(self.cfg.services, self.proxier, node=self.node,
                               on_error=lambda e: self.metrics.config_errors.labels("manifest").inc())
            src.load_initial()
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


def bpf_lb_mode(cfg: ProxyConfig, external: Placement | None) -> str | None:
    """/services' bpfLbMode: --bpf-lb-mode ("snat" or "dsr", usproxy/offload/bpf/dsr.h) for a
    ServicePort whose traffic from outside the node the tc programs serve (its NodePort, externalIPs
    and LoadBalancer IPs alike, as Cilium's bpf-lb-mode), else None."""
    if external is None or external.datapath != "tc" or cfg.offload != "bpf":
        return None
    return cfg.bpf_lb_mode


_limited = RateLimitedLog(log)
def _endpoint_row(ep: Endpoint, usable: set[Endpoint]) -> dict[str, Any]:
    return {"address": str(ep), "ready": ep.ready, "serving": ep.serving, "terminating": ep.terminating,
            "nodeName": ep.node_name, "usable": ep in usable}


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Errors the loop reports (e.g. accept() failing with EMFILE, after which asyncio backs off
    and retries by itself) are logged at a bounded rate instead of once per event."""
    exc = context.get("exception")
    _limited.warning("event loop: %s%s", context.get("message", "error"), f": {exc!r}" if exc else "")


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
