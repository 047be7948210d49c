"""Proxier: owns the change trackers and maps, and drives the datapaths in `sync()`.

Sources call the Provider methods (`on_service_update`, `on_endpoint_slice_update`,
`on_services_synced`, `on_endpoint_slices_synced`); each change queues a sync on the SyncRunner.
Nothing syncs before every source has listed once (as kube-proxy's isInitialized). A sync hands
each datapath only the ServicePorts that changed; a failed sync makes the next one full, and so
does the passing of `full_sync_period` (10 × the sync period), so datapaths can repair state
changed behind their back (as kube-proxy's periodic full syncs).

After the datapaths applied a sync, the service health server (when the agent set
`service_health`) gets each healthCheckNodePort and the count of local ready endpoints per Service
(distinct addresses, as kube-proxy's EndpointsMap.LocalReadyEndpoints), kept per ServicePort and
updated only for the ServicePorts a sync hands over.

Only a source change starts a measurement of kubeproxy_network_programming_duration_seconds; a
datapath asking for a sync of its own accord (`request_sync`: an offload window ended) does not.

A sync whose changed slices hold OFF_LOOP endpoints or more merges and compares them in a worker
thread (`_endpoints_diff`), so that a relist or a rewritten manifest does not stall the relay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily

from usproxy.util.metrics import Metrics
from usproxy.model.datapath_name import DATAPATH_NAMES
from usproxy.core.datapath import Datapath, Placement, ServiceCIDRHandler, ServicePortState, SyncRequest
from usproxy.model.endpoint import Endpoint, categorize
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.core.frontend_claims import CLUSTER_IP, FrontendClaims, describe, without_frontends
from usproxy.util.gc_pause import LARGE, freeze_heap, gc_paused, promote_survivors
from usproxy.util.heap import give_back_free_heap
from usproxy.core.endpoints_change_tracker import (EndpointsChangeTracker, EndpointsDiff, EndpointsMap, endpoint_count,
                                              endpoints_diff, merge_taken)
from usproxy.model.node import NodeFacts
from usproxy.model.service import Service
from usproxy.core.service_change_tracker import ServiceChangeTracker, ServicePortMap
from usproxy.core.sync_runner import SyncRunner
from usproxy.model.types import IPAddress, IPNetwork, NamespacedName, ServicePortName

log = logging.getLogger(__name__)
PLACEMENT_CHUNK = 250  # ServicePorts whose placement is counted between two turns of the loop (~0.5 ms)
OFF_LOOP = 5000  # endpoints in one sync's changed slices from which they are merged in a thread (~20 ms)


class ServiceHealthSink(Protocol):
    """Where the Proxier reports health checks after each successful sync (kube-proxy's
    ServiceHealthServer SyncServices + SyncEndpoints): `ports` per Service that has a
    healthCheckNodePort, `counts` of local ready endpoints per Service."""

    async def sync(self, ports: Mapping[NamespacedName, int], counts: Mapping[NamespacedName, int]) -> None: ...


class Proxier:
    """The mode-free core. `datapaths` are synced in order, each layering over those before it
    (kernel offload over the relay); see `placement()` for which one is reported as serving a
    ServicePort. `node` is this node (its name decides which endpoints are local)."""

    def __init__(
        self,
        datapaths: Sequence[Datapath],
        *,
        node: NodeFacts = NodeFacts(),
        metrics: Metrics | None = None,
        zone: str | None = None,
        min_sync_period: float = 1.0,
        sync_period: float = 30.0,
    ) -> None:
        self.datapaths = list(datapaths)
        self.metrics = metrics or Metrics()
        self.node = node
        self.zone = zone
        self.service_tracker = ServiceChangeTracker()
        self.endpoints_tracker = EndpointsChangeTracker()
        self.service_map = ServicePortMap()
        self.endpoints_map = EndpointsMap()
        self._cluster_ips: dict[IPAddress, int] = {}  # ClusterIP -> number of ServicePorts using it
        # int(ClusterIP) -> how many ClusterIPs have that int (an IPv4 and an IPv6 address may):
        # endpoints are screened by int first, as hashing an ipaddress object runs Python code
        # (~1.5 µs: 30 ms for a ServicePort of 20,000 endpoints) and int() is 5 times cheaper
        self._cluster_ip_ints: dict[int, int] = {}
        self._counted: dict[ServicePortName, tuple[IPAddress, ...]] = {}
        self.claims = FrontendClaims()  # one owner per frontend, for every datapath
        self.service_health: ServiceHealthSink | None = None
        # healthCheckNodePort and local ready endpoint addresses, per ServicePort that has one
        self._health: dict[ServicePortName, tuple[int, frozenset[IPAddress]]] = {}
        self._synced = {"services": False, "endpointslices": False}
        self._need_full = True
        self.full_sync_period = 10 * sync_period  # seconds between full syncs (drift repair)
        self._last_full = 0.0
        self.last_updated: float | None = None  # wall time of the last successful sync
        self.oldest_queued: float | None = None  # wall time of the oldest change not yet synced
        self.runner = SyncRunner(self.sync, min_interval=min_sync_period, max_interval=sync_period,
                                 on_queued=self._queued)
        self.metrics.register_staged(_PlacementCollector(self))

    # -- Provider ---------------------------------------------------------------------------
    def on_service_update(self, previous: Service | None, current: Service | None) -> None:
        pending = self.service_tracker.update(previous, current)
        self.metrics.service_changes_pending.set(self.service_tracker.pending_count())
        if pending:
            self.runner.run()

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None:
        pending = self.endpoints_tracker.update(previous, current)
        self.metrics.endpoint_changes_pending.set(self.endpoints_tracker.pending_count())
        if pending:
            self.runner.run()

    def on_services_synced(self) -> None:
        self._synced["services"] = True
        self.runner.run()

    def on_endpoint_slices_synced(self) -> None:
        self._synced["endpointslices"] = True
        self.runner.run()

    def hold_syncs(self) -> AbstractContextManager[None]:
        """No sync starts while the returned context is open (a source applying a relist in
        chunks); changes keep queueing and sync once it closes (SyncRunner.hold)."""
        return self.runner.hold()

    def request_sync(self) -> None:
        """Sync soon on a datapath's own behalf (an offload window ended). Not a source change:
        it starts no network-programming measurement and is not counted as queued."""
        self.runner.retry_after(0.0)

    def request_full_sync(self) -> None:
        """A fact every datapath derives from changed (this node's NodePort addresses): every
        ServicePort goes to every datapath at the next sync."""
        self._need_full = True
        self.runner.run()

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        """The cluster's ServiceCIDR objects changed (kube-proxy's OnServiceCIDRsChanged;
        `cidrs`: all of them): told to every datapath that checks them, and the next sync is a
        full one, which rewrites the nftables table's hooked chains (`cluster-ips-check`)."""
        for dp in self.datapaths:
            if isinstance(dp, ServiceCIDRHandler):
                dp.on_service_cidrs_changed(cidrs)
        self.request_full_sync()

    def set_zone(self, zone: str | None) -> None:
        """This node's topology zone changed: every ServicePort is re-filtered at the next sync."""
        if zone != self.zone:
            self.zone = zone
            self._need_full = True
            self.runner.run()

    @property
    def initialized(self) -> bool:
        return all(self._synced.values())

    def _queued(self) -> None:
        now = time.time()
        self.metrics.sync_last_queued.set(now)
        if self.oldest_queued is None:
            self.oldest_queued = now

    # -- sync -------------------------------------------------------------------------------
    async def sync(self) -> None:
        """One sync: apply tracked changes and hand them to every datapath."""
        if not self.initialized:
            log.debug("not syncing: sources have not listed yet")
            return
        start = time.monotonic()
        queued = self.oldest_queued
        pending = self.service_tracker.pending_count() + self.endpoints_tracker.pending_count()
        large = self._need_full or pending > LARGE
        with gc_paused(large):  # the whole sync: one collection after it
            request = self._build_request(await self._endpoints_diff())
            self.metrics.service_changes_pending.set(0)
            self.metrics.endpoint_changes_pending.set(0)
            try:
                for dp in self.datapaths:
                    await dp.sync(request)
                if self.service_health is not None:
                    await self.service_health.sync(*self.health_checks())
            except Exception:
                self._need_full = True
                self.metrics.sync_failures.inc()
                raise
            if large:  # before the collector is back: its first allocation would walk the whole heap
                freeze_heap()  # its state lives as long as the agent: no full collection walks it (gc_pause)
        self._need_full = False
        self._finish(start, queued)
        if large:  # after the sync is in force (/healthz): housekeeping
            await give_back_free_heap()  # the burst's transients (a transaction's text, a parse) are free now

    def _finish(self, start: float, queued: float | None) -> None:
        now = time.time()
        self.metrics.sync_duration.observe(time.monotonic() - start)
        self.metrics.sync_last_timestamp.set(now)
        if queued is not None:
            self.metrics.network_programming.observe(max(0.0, now - queued))
        self.last_updated = now
        if self.oldest_queued == queued:
            self.oldest_queued = None

    def placement_counts(self) -> dict[str, int]:
        """ServicePorts per serving datapath (computed when /metrics is scraped, not per sync)."""
        counts: dict[str, int] = dict.fromkeys(DATAPATH_NAMES, 0)
        for spn in self.service_map:
            where = self.placement(spn).datapath
            counts[where] = counts.get(where, 0) + 1
        return counts

    async def placement_counts_chunked(self) -> dict[str, int]:
        """`placement_counts()`, PLACEMENT_CHUNK ServicePorts at a time with the loop running
        between chunks (5,000 in one piece: ~10 ms). Each ServicePort is counted as it is when
        its turn comes; one removed meanwhile is not counted."""
        counts: dict[str, int] = dict.fromkeys(DATAPATH_NAMES, 0)
        names = list(self.service_map)
        for at in range(0, len(names), PLACEMENT_CHUNK):
            for spn in names[at:at + PLACEMENT_CHUNK]:
                if spn in self.service_map:
                    where = self.placement(spn).datapath
                    counts[where] = counts.get(where, 0) + 1
            await asyncio.sleep(0)
        return counts

    async def _endpoints_diff(self) -> EndpointsDiff:
        """The tracked endpoint changes, merged and compared in a worker thread when they hold
        OFF_LOOP endpoints or more (a ServicePort of 20,000 endpoints rewritten: ~0.1 s on the
        loop); only values cross to the thread (EndpointsChangeTracker.take). Changes tracked
        meanwhile wait for the next sync, as any change during a sync."""
        taken = self.endpoints_tracker.take()
        if endpoint_count(taken) < OFF_LOOP:
            return endpoints_diff(merge_taken(taken))
        # The collector is paused meanwhile (a full pass over the heap in the thread holds the GIL
        # ~50 ms) and what survives, the new endpoints, is promoted unscanned (gc_pause).
        with gc_paused(True):
            diff = await asyncio.to_thread(lambda: endpoints_diff(merge_taken(taken)))
            promote_survivors()
        return diff

    def _build_request(self, ep_diff: EndpointsDiff) -> SyncRequest:
        svc_change = self.service_map.update_from(self.service_tracker)
        ep_change = self.endpoints_map.apply(ep_diff)
        self.metrics.service_changes_total.inc(len(svc_change.changed))
        self.metrics.endpoint_changes_total.inc(len(ep_change.updated))
        changed = svc_change.changed | ep_change.updated
        changed |= self._track_cluster_ips(svc_change.changed)
        self.claims.begin()
        for spn in svc_change.changed:
            changed |= self.claims.update(spn, self.service_map.get(spn))
        full = self._need_full or time.monotonic() - self._last_full >= self.full_sync_period
        if full:
            self._last_full = time.monotonic()
        names = set(self.service_map) | changed if full else changed
        changes = {spn: self.state_of(spn) for spn in names}
        self._track_health(changes)
        removed = {spn: frozenset(eps) for spn, eps in ep_change.removed.items()}
        return SyncRequest(changes=changes, removed_endpoints=removed, full=full)

    def _track_health(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """Record the healthCheckNodePort and local ready endpoints of the changed ServicePorts."""
        for spn, st in changes.items():
            port = st.service_port.health_check_node_port if st is not None else 0
            if st is None or not port:
                self._health.pop(spn, None)
                continue
            local = frozenset(ep.ip for ep in st.endpoints
                              if ep.ready and self.node.name is not None and ep.node_name == self.node.name)
            self._health[spn] = (port, local)

    def health_checks(self) -> tuple[dict[NamespacedName, int], dict[NamespacedName, int]]:
        """(healthCheckNodePort per Service, local ready endpoints per Service): an address
        counts once however many ports of the Service it serves (as kube-proxy)."""
        ports: dict[NamespacedName, int] = {}
        local: dict[NamespacedName, set[IPAddress]] = {}
        for spn, (port, ips) in self._health.items():
            ports[spn.service] = port
            local.setdefault(spn.service, set()).update(ips)
        return ports, {name: len(ips) for name, ips in local.items() if ips}

    def _track_cluster_ips(self, changed: set[ServicePortName]) -> set[ServicePortName]:
        """Update ClusterIP reference counts for the changed ServicePorts (cost proportional to
        the change); return ServicePorts whose endpoints must be re-filtered because an address
        became, or stopped being, a ClusterIP."""
        moved: set[IPAddress] = set()
        counts = self._cluster_ips
        for spn in changed:
            for ip in self._counted.pop(spn, ()):
                n = counts[ip] - 1
                if n:
                    counts[ip] = n
                else:
                    del counts[ip]
                    self._count_int(int(ip), -1)
                    moved.symmetric_difference_update((ip,))
            sp = self.service_map.get(spn)
            if sp is not None:
                self._counted[spn] = sp.cluster_ips
                for ip in sp.cluster_ips:
                    n = counts[ip] = counts.get(ip, 0) + 1
                    if n == 1:
                        self._count_int(int(ip), 1)
                        moved.symmetric_difference_update((ip,))
        if not moved:
            return set()
        # ServicePorts already changed are re-filtered anyway (the whole of a cold sync)
        ints = {int(ip) for ip in moved}
        return {spn for spn, eps in self.endpoints_map.items()
                if spn not in changed and any(int(ep.ip) in ints and ep.ip in moved for ep in eps)}

    def _count_int(self, key: int, delta: int) -> None:
        n = self._cluster_ip_ints.get(key, 0) + delta
        if n:
            self._cluster_ip_ints[key] = n
        else:
            del self._cluster_ip_ints[key]

    def state_of(self, spn: ServicePortName) -> ServicePortState | None:
        """The ServicePortState the datapaths should hold for `spn` now (None: removed)."""
        sp = self.service_map.get(spn)
        if sp is None:
            return None
        lost = self.claims.lost(spn)
        if lost:
            if CLUSTER_IP in lost.values():  # its ClusterIP:port is another's: not served at all
                return None
            sp = without_frontends(sp, lost)
        eps = tuple(self._acceptable(spn, self.endpoints_map.get(spn, ())))
        cat = categorize(sp, eps, self.node.name, self.zone)
        short = cat.cluster_policy if sp.external_traffic_policy == "Local" else ()
        return ServicePortState(sp, eps, cat.cluster, cat.external, short)

    def _acceptable(self, spn: ServicePortName, eps: Sequence[Endpoint]) -> list[Endpoint]:
        out = []
        ints = self._cluster_ip_ints
        for ep in eps:
            if int(ep.ip) in ints and ep.ip in self._cluster_ips:
                log.error("EndpointSlice of %s: endpoint %s is a ClusterIP, refused", spn, ep)
                continue
            out.append(ep)
        return out

    def placement(self, spn: ServicePortName) -> Placement:
        """Who serves `spn` and why: the last datapath that places it (a later one layers over
        those before it), except that an error of the datapath serving it (a relay listener
        that cannot bind) is never hidden by a later datapath's note about that same datapath
        (the offload manager's "establishing" while the relay serves)."""
        lost = self.claims.lost(spn)
        if CLUSTER_IP in lost.values():
            key = next(k for k, r in lost.items() if r == CLUSTER_IP)
            return Placement("none", f"{describe(key)} is served by {self.claims.owner_of(key)}")
        where: Placement | None = None
        for dp in self.datapaths:
            here = dp.placement(spn)
            if here is None or (where is not None and where.error and here.datapath == where.datapath):
                continue
            where = here
        return where or Placement("none", "not synced")

    async def close(self) -> None:
        for dp in reversed(self.datapaths):
            try:
                await dp.close()
            except Exception:
                log.exception("closing datapath %s", dp.name)


class _PlacementCollector:
    """usproxy_service_ports{datapath}: evaluated at scrape time, so a sync never walks every
    ServicePort just to keep a gauge current; staged in chunks before a scrape (Metrics.scrape)."""

    def __init__(self, proxier: Proxier) -> None:
        self.proxier = proxier
        self.staged: dict[str, int] | None = None

    async def stage(self) -> dict[str, int]:
        return await self.proxier.placement_counts_chunked()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("usproxy_service_ports", "ServicePorts by the datapath serving them",
                                   labels=["datapath"])
        counts = self.staged if self.staged is not None else self.proxier.placement_counts()
        for name, n in sorted(counts.items()):
            family.add_metric([name], n)
        yield family
