"""Kubernetes API source: v1 Services and discovery.k8s.io/v1 EndpointSlices from a live API server.

As kube-proxy's config handlers over shared informers: one Reflector per resource (list, then
watch; see reflector.py) feeds an ObjectCache, which parses raw bodies with the same functions as
the static source and hands (previous, current) pairs to the Provider. A third Reflector follows
this node's Node object for its `topology.kubernetes.io/zone` label and for whether the Node is
being deleted (`node_eligible`, kube-proxy's /healthz nodeEligible). A fourth follows the
networking.k8s.io/v1 ServiceCIDR objects and hands the union of their CIDRs to the Provider when it
changes (kube-proxy's ServiceCIDRConfig); a server that does not serve them (404: a cluster older
than Kubernetes 1.33, or the API not enabled) is logged once and not asked again.

detectLocalMode NodeCIDR as kube-proxy (cmd/kube-proxy/app/server_linux.go waitForPodCIDR,
pkg/proxy/node.go NodeManager): before the agent is built, `wait_for_pod_cidrs` asks for this
Node every second until it has spec.podCIDRs (at most 5 minutes, then the agent exits to be
restarted); afterwards LocalNode compares every version of the Node with the pod CIDRs the
detector was built from, and a change ends the source (`PodCIDRsChanged`), so the agent exits
to be restarted with the new ones, as kube-proxy does.

Invariants:
- `on_services_synced` / `on_endpoint_slices_synced` are called once, after the first successful
  list of that resource; nothing syncs before (kube-proxy's isInitialized).
- ServiceCIDRs do not hold back the first sync (as kube-proxy's isInitialized ignores them): until
  they are listed the datapaths check --service-cidr alone.
- A relist delivers deletes for objects that vanished between the two lists and nothing for
  objects that did not change; it never flushes.
- An unreachable API server changes nothing: the Provider keeps the last known state and the
  datapaths keep serving it. Only the server can delete.
- An invalid object is logged naming object and field, counted in `usproxy_config_errors{kind}`,
  and its previous good version stays in force; other objects are unaffected.
- Filtering as kube-proxy: `!service.kubernetes.io/headless` as a server-side label selector on
  both resources; headless and ExternalName Services, and objects whose
  `service.kubernetes.io/service-proxy-name` names another proxy, skipped client-side (a label
  selector cannot say "absent or usproxy").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import yaml

from usproxy.util.metrics import Metrics
from usproxy.model.config import ProxyConfig
from usproxy.model.node import PodCIDRsChanged, parse_node_pod_cidrs
from usproxy.model.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.util.errors import ConfigError, SourceError
from usproxy.util.gc_pause import gc_paused, promote_survivors
from usproxy.model.service import PROXY_NAME, PROXY_NAME_LABEL, Service, parse_service, skip_reason
from usproxy.sources import Provider, hold_syncs, kube_client
from usproxy.core.datapath import ServiceCIDRHandler
from usproxy.model.service_cidr import ServiceCIDR, ServiceCIDRTracker, parse_service_cidr
from usproxy.sources.api_list_watch import ENDPOINT_SLICES, NODES, SERVICE_CIDRS, SERVICES, ApiListWatch
from usproxy.sources.reflector import ApiError, ListResult, ListWatch, RawObject, WatchEvent, Reflector, ReflectorOptions
from usproxy.util.time_slice import TimeSlice
from usproxy.model.types import IPNetwork, NamespacedName

log = logging.getLogger(__name__)

HEADLESS_LABEL = "service.kubernetes.io/headless"
ZONE_LABEL = "topology.kubernetes.io/zone"
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
LABEL_SELECTOR = f"!{HEADLESS_LABEL}"  # kube-proxy's server-side filter (cmd/kube-proxy/app/server.go)
USER_AGENT = "usproxy/0.1.0"
POD_CIDR_WAIT = 300.0  # seconds the agent waits for this Node's podCIDRs (kube-proxy's timeoutForNodePodCIDR)

T = TypeVar("T")


class NodeAwareProvider(Provider, Protocol):
    """A Provider that also takes this node's zone (the Proxier reads it at sync)."""

    zone: str | None

    def set_zone(self, zone: str | None) -> None: ...


def _key(raw: RawObject) -> NamespacedName | None:
    meta = raw.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        return None
    ns = meta.get("namespace")
    return NamespacedName(ns if isinstance(ns, str) and ns else "default", meta["name"])


@dataclass(frozen=True, slots=True)
class Parsed(Generic[T]):
    """One raw object read without touching any state: its name (None: it has none), why it is
    skipped (None: it is not), and its parse (`value`) or the ConfigError that refused it."""

    name: NamespacedName | None
    skip: str | None = None
    value: T | None = None
    error: ConfigError | None = None


class ObjectCache(Generic[T]):
    """Parsed objects of one kind by namespace/name: the Store of one Reflector.

    Delivers (previous, current) pairs only for real change; keeps the last good version of an
    object whose new version does not parse. A full list is parsed in a worker thread and
    delivered a TimeSlice at a time, with the loop running in between and the Provider's syncs
    held (`hold`), so a relist of 100,000 endpoints neither stalls the relay nor is synced
    half-applied.
    """

    def __init__(self, kind: str, *, parse: Callable[[RawObject], T], skip: Callable[[RawObject], str | None],
                 deliver: Callable[[T | None, T | None], None], on_synced: Callable[[], None],
                 on_error: Callable[[str], None],
                 hold: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.kind = kind
        self.parse = parse
        self.skip = skip
        self.deliver = deliver
        self.on_synced = on_synced
        self.on_error = on_error
        self.hold = hold
        self.objects: dict[NamespacedName, T] = {}
        self.skipped: set[NamespacedName] = set()
        self.synced = False

    async def replace(self, items: list[Any]) -> None:
        """A full list: deletes for what vanished, updates for what changed, then synced once.
        `items` are raw objects or already `read` (an ApiListWatch given this cache's `read`
        parses each item as it decodes it). Parsing (pure) runs in a worker thread; delivery on
        the loop, giving it a turn every TimeSlice budget; the cyclic collector is paused
        throughout (gc_pause)."""
        with gc_paused(True):  # the collector's passes over a growing heap stall the loop 0.1-0.2 s
            await self._replace(items)
            promote_survivors()

    async def _replace(self, items: list[Any]) -> None:
        parsed = await asyncio.to_thread(lambda: [i if isinstance(i, Parsed) else self.read(i) for i in items])
        turn = TimeSlice()
        with self.hold():
            present = {p.name for p in parsed if p.name is not None}
            for name in [n for n in self.objects if n not in present]:
                self.deliver(self.objects.pop(name), None)
                await turn.pause()
            self.skipped &= present
            for p in parsed:
                self._take(p)
                await turn.pause()
            if not self.synced:
                self.synced = True
                self.on_synced()

    def upsert(self, obj: dict[str, Any]) -> None:
        self._take(self.read(obj))

    def read(self, obj: RawObject) -> Parsed[T]:
        """Name, skip reason and parse of `obj`; reads no state (runs in a worker thread)."""
        name = _key(obj)
        if name is None:
            return Parsed(None, error=ConfigError("metadata.name: required", obj=self.kind))
        why = self.skip(obj)
        if why is not None:
            return Parsed(name, skip=why)
        try:
            return Parsed(name, value=self.parse(obj))
        except ConfigError as err:
            return Parsed(name, error=err)

    def _take(self, p: Parsed[T]) -> None:
        """Apply one read object: refused, skipped, or delivered when it changed."""
        name, current = p.name, p.value
        if name is None or current is None:
            if name is not None and p.skip is not None:
                self._skip(name, p.skip)
            elif p.error is not None:
                if name is not None:
                    self.skipped.discard(name)
                self._invalid(p.error, kept=name in self.objects)
            return
        self.skipped.discard(name)
        previous = self.objects.get(name)
        if previous != current:
            self.objects[name] = current
            self.deliver(previous, current)

    def delete(self, obj: dict[str, Any]) -> None:
        name = _key(obj)
        if name is None:
            return
        self.skipped.discard(name)
        if name in self.objects:
            self.deliver(self.objects.pop(name), None)

    def _skip(self, name: NamespacedName, why: str) -> None:
        if name not in self.skipped:
            log.info("%s %s: %s; not proxied", self.kind, name, why)
            self.skipped.add(name)
        if name in self.objects:  # e.g. a Service relabelled for another proxy: it leaves us
            self.deliver(self.objects.pop(name), None)

    def _invalid(self, err: ConfigError, kept: bool = False) -> None:
        log.error("%s; %s", err, "keeping its previous version" if kept else "skipped")
        self.on_error(self.kind)


def slice_skip_reason(raw: RawObject) -> str | None:
    """Why kube-proxy would not see this EndpointSlice (its informer's label selector)."""
    meta = raw.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    if not isinstance(labels, Mapping):
        return None
    if labels.get(PROXY_NAME_LABEL) not in (None, PROXY_NAME):
        return f"labelled {PROXY_NAME_LABEL}={labels.get(PROXY_NAME_LABEL)}"
    if HEADLESS_LABEL in labels:
        return f"labelled {HEADLESS_LABEL}"
    return None


class LocalNode:
    """Store of this node's Node object: its zone for the Provider, and whether it is eligible.

    The zone narrows endpoints by topology hints (trafficDistribution PreferClose); a zone that
    changes after the first sync applies to each ServicePort at its next change. Eligibility is
    kube-proxy's ProxierHealthServer.SyncNode: a Node being deleted (deletionTimestamp, or the
    ToBeDeletedByClusterAutoscaler taint) or gone makes /healthz fail so load balancers drain it,
    while /livez stays healthy. With `pod_cidrs` (detectLocalMode NodeCIDR: the spec.podCIDRs the
    detector was built from), a version of the Node whose podCIDRs differ sets `restart` (kube-proxy's
    NodeManager.OnNodeChange exits then); one whose podCIDRs do not parse is logged and changes
    nothing.
    """

    def __init__(self, node_name: str, provider: NodeAwareProvider,
                 pod_cidrs: tuple[IPNetwork, ...] | None = None) -> None:
        self.node_name = node_name
        self.provider = provider
        self.eligible = True
        self.pod_cidrs = pod_cidrs
        self.restart: str | None = None  # why the agent must restart (set once)
        self.restart_needed = asyncio.Event()

    async def replace(self, items: list[dict[str, Any]]) -> None:
        mine = [n for n in items if (n.get("metadata") or {}).get("name") == self.node_name]
        if not mine:
            log.warning("Node %s not found; topology zone unknown", self.node_name)
        for node in mine:
            self.upsert(node)

    def upsert(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if meta.get("name") != self.node_name:
            return
        self._set_zone(meta.get("labels"))
        taints = (obj.get("spec") or {}).get("taints") or []
        deleting = bool(meta.get("deletionTimestamp")) or any(
            isinstance(t, Mapping) and t.get("key") == TO_BE_DELETED_TAINT for t in taints)
        self._set_eligible(not deleting)
        self._check_pod_cidrs(obj)

    def _check_pod_cidrs(self, obj: dict[str, Any]) -> None:
        if self.pod_cidrs is None or self.restart is not None:
            return
        try:
            now = parse_node_pod_cidrs(obj).pod_cidrs
        except ConfigError as err:
            log.error("%s; detectLocalMode NodeCIDR keeps %s", err, _cidrs_text(self.pod_cidrs))
            return
        if now != self.pod_cidrs:
            self.restart = (f"Node {self.node_name}: spec.podCIDRs changed from {_cidrs_text(self.pod_cidrs)} "
                            f"to {_cidrs_text(now)}; detectLocalMode NodeCIDR reads them at start: "
                            "exiting to be restarted, as kube-proxy")
            self.restart_needed.set()

    def delete(self, obj: dict[str, Any]) -> None:
        """A deleted Node keeps its last zone (the proxy serves until stopped) but is not eligible."""
        if (obj.get("metadata") or {}).get("name") == self.node_name:
            self._set_eligible(False)

    def _set_zone(self, labels: object) -> None:
        zone = labels.get(ZONE_LABEL) if isinstance(labels, Mapping) else None
        zone = zone if isinstance(zone, str) and zone else None
        if zone != self.provider.zone:
            log.info("Node %s: zone %s", self.node_name, zone or "<none>")
            self.provider.set_zone(zone)

    def _set_eligible(self, eligible: bool) -> None:
        if eligible != self.eligible:
            log.info("Node %s: %s", self.node_name, "eligible again" if eligible else "being deleted")
            self.eligible = eligible


def _cidrs_text(cidrs: tuple[IPNetwork, ...]) -> str:
    return ", ".join(map(str, cidrs)) or "none"


ClientConfig = Callable[[], Awaitable[Any]]


def client_config(kubeconfig: Path | None) -> ClientConfig:
    """Check the kubeconfig (or in-cluster environment) now; return how to build the Configuration.

    Raises ConfigError naming the file when it cannot be used (`usproxy run` exits 2).
    """
    kube_client.load()
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config import ConfigException
    from kubernetes_asyncio.config.incluster_config import load_incluster_config
    from kubernetes_asyncio.config.kube_config import KubeConfigLoader, KubeConfigMerger

    if kubeconfig is None:
        configuration = Configuration()
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except ConfigException as err:
            raise ConfigError(str(err), obj="in-cluster configuration") from None

        async def in_cluster() -> Any:
            return configuration
        return in_cluster
    where = f"kubeconfig {kubeconfig}"
    if not kubeconfig.is_file():
        raise ConfigError("no such file", obj=where)
    try:
        loader = KubeConfigLoader(config_dict=KubeConfigMerger(str(kubeconfig)).config, config_base_path=None)
    except (ConfigException, OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"cannot use: {' '.join(str(err).split())}", obj=where) from None

    async def from_file() -> Any:
        configuration = Configuration()
        try:
            await loader.load_and_set(configuration)
        except (ConfigException, OSError, KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"cannot use: {' '.join(str(err).split())}", obj=where) from None
        return configuration
    return from_file


class KubeSource:
    """Feeds a Provider from a live API server: Services, EndpointSlices, and the zone and
    eligibility of the Node named `node_name` (the agent's NodeFacts.name); `pod_cidrs` the
    Node's spec.podCIDRs the NodeCIDR detector was built from (NodeFacts.pod_cidrs), whose change
    ends run() with PodCIDRsChanged."""

    def __init__(self, cfg: ProxyConfig, provider: NodeAwareProvider, metrics: Metrics | None = None, *,
                 node_name: str, options: ReflectorOptions | None = None, node_wait: float = 5.0,
                 pod_cidrs: tuple[IPNetwork, ...] | None = None) -> None:
        self.provider = provider
        self.metrics = metrics
        self.options = options or ReflectorOptions()
        self.node_wait = node_wait
        self.node_name = node_name
        self._client_config = client_config(cfg.kubeconfig)
        self.services: ObjectCache[Service] = ObjectCache(
            "Service", parse=parse_service, skip=skip_reason, deliver=provider.on_service_update,
            on_synced=provider.on_services_synced, on_error=self._count_error, hold=self._hold)
        self.slices: ObjectCache[EndpointSlice] = ObjectCache(
            "EndpointSlice", parse=parse_endpoint_slice, skip=slice_skip_reason,
            deliver=provider.on_endpoint_slice_update, on_synced=provider.on_endpoint_slices_synced,
            on_error=self._count_error, hold=self._hold)
        self.node = LocalNode(self.node_name, provider, pod_cidrs)
        self.service_cidr_tracker = ServiceCIDRTracker(self._service_cidrs_changed)
        self.service_cidrs: ObjectCache[ServiceCIDR] = ObjectCache(
            "ServiceCIDR", parse=parse_service_cidr, skip=lambda raw: None, deliver=self.service_cidr_tracker.update,
            on_synced=lambda: None, on_error=self._count_error)
        self.reflectors: dict[str, Reflector] = {}

    @property
    def node_eligible(self) -> bool:
        """For /healthz (kube-proxy's nodeEligible): False while this Node is being deleted."""
        return self.node.eligible

    def _service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        log.info("ServiceCIDRs: %s", ", ".join(map(str, cidrs)) or "none")
        if isinstance(self.provider, ServiceCIDRHandler):
            self.provider.on_service_cidrs_changed(cidrs)

    def _hold(self) -> AbstractContextManager[None]:
        return hold_syncs(self.provider)

    def _count_error(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.config_errors.labels(kind).inc()

    async def run(self) -> None:
        """Run the reflectors until cancelled. The Node is looked up first (for at most
        `node_wait` seconds) so the first sync already knows the zone. Raises PodCIDRsChanged
        when the Node's podCIDRs differ from `pod_cidrs` (NodeCIDR mode)."""
        kube_client.load()
        from kubernetes_asyncio.client import ApiClient

        configuration = await self._client_config()
        async with ApiClient(configuration) as api:
            api.user_agent = USER_AGENT
            self.reflectors = self._reflectors(api)
            async with asyncio.TaskGroup() as tasks:
                node = self.reflectors["node"]
                running = [tasks.create_task(node.run(), name="reflector-node")]
                with suppress(TimeoutError):
                    await asyncio.wait_for(node.attempted.wait(), self.node_wait)
                for name in ("services", "endpointslices", "servicecidrs"):
                    running.append(tasks.create_task(self.reflectors[name].run(), name=f"reflector-{name}"))
                await self.node.restart_needed.wait()  # never set unless NodeCIDR's podCIDRs change
                for task in running:
                    task.cancel()
        raise PodCIDRsChanged(self.node.restart or "")

    def _reflectors(self, api: Any) -> dict[str, Reflector]:
        opts = self.options
        node_lw = ApiListWatch(api, NODES, field_selector=f"metadata.name={self.node_name}", options=opts)
        svc_lw = ApiListWatch(api, SERVICES, label_selector=LABEL_SELECTOR, options=opts, read=self.services.read)
        eps_lw = ApiListWatch(api, ENDPOINT_SLICES, label_selector=LABEL_SELECTOR, options=opts, read=self.slices.read)
        cidr_lw = OptionalListWatch(ApiListWatch(api, SERVICE_CIDRS, options=opts), "ServiceCIDRs")
        return {
            "node": Reflector(f"Node {self.node_name}", node_lw, self.node, opts),
            "services": Reflector("Services", svc_lw, self.services, opts),
            "endpointslices": Reflector("EndpointSlices", eps_lw, self.slices, opts),
            "servicecidrs": Reflector("ServiceCIDRs", cidr_lw, self.service_cidrs, opts),
        }


async def wait_for_pod_cidrs(cfg: ProxyConfig, node_name: str, *, timeout: float = POD_CIDR_WAIT,
                             interval: float = 1.0, remind: float = 30.0,
                             options: ReflectorOptions | None = None) -> tuple[IPNetwork, ...]:
    """This Node's spec.podCIDRs, for detectLocalMode NodeCIDR, as kube-proxy's waitForPodCIDR
    (cmd/kube-proxy/app/server_linux.go): the Node named `node_name` is listed every `interval`
    seconds until it exists, is not being deleted and has pod CIDRs; the wait is logged at once
    and every `remind` seconds, naming the Node. Raises SourceError after `timeout` seconds
    (kube-proxy gives up after 5 minutes and exits), ConfigError for an unusable kubeconfig or
    podCIDRs that do not parse (naming the Node and spec.podCIDRs)."""
    kube_client.load()
    from kubernetes_asyncio.client import ApiClient

    configuration = await client_config(cfg.kubeconfig)()
    loop = asyncio.get_running_loop()
    start = last_log = loop.time()
    async with ApiClient(configuration) as api:
        api.user_agent = USER_AGENT
        lw = ApiListWatch(api, NODES, field_selector=f"metadata.name={node_name}", options=options)
        log.info("detectLocalMode NodeCIDR: waiting for Node %s to have spec.podCIDRs", node_name)
        while True:
            why = await _node_pod_cidrs(lw, node_name)
            if isinstance(why, tuple):
                log.info("Node %s: podCIDRs %s (detectLocalMode NodeCIDR)", node_name, _cidrs_text(why))
                return why
            if loop.time() - start >= timeout:
                raise SourceError(f"timeout waiting for Node {node_name} to have spec.podCIDRs, needed by "
                                  f"detectLocalMode NodeCIDR (--detect-local-mode), after {timeout:g} s: {why}")
            if loop.time() - last_log >= remind:
                log.warning("detectLocalMode NodeCIDR: still waiting for Node %s: %s", node_name, why)
                last_log = loop.time()
            await asyncio.sleep(interval)


async def _node_pod_cidrs(lw: ApiListWatch, node_name: str) -> tuple[IPNetwork, ...] | str:
    """The Node's podCIDRs when it is ready for NodeCIDR, else why not (a text)."""
    try:
        items = (await lw.list("")).items
    except (SourceError, aiohttp.ClientError, OSError, TimeoutError) as err:
        return f"cannot read it: {type(err).__name__}: {err}"
    nodes = [parse_node_pod_cidrs(raw) for raw in items if (raw.get("metadata") or {}).get("name") == node_name]
    if not nodes:
        return "no such Node"
    if nodes[0].deleting:
        return "it is being deleted"
    return nodes[0].pod_cidrs or "it has no spec.podCIDRs yet"


class OptionalListWatch:
    """The ListWatch of a resource older API servers do not serve (ServiceCIDR: GA in Kubernetes
    1.33). A list answered 404 is logged once and then never returns, so its Reflector waits
    (until cancelled) instead of asking again every 30 s; the Store keeps what it has (nothing).
    A list answered 403 (a ClusterRole without the resource) is retried as kube-proxy's informer
    retries it (the Reflector's backoff, up to 30 s; nothing waits for it), with one warning that
    names the missing grant; only --service-cidr is checked meanwhile."""

    def __init__(self, lw: ListWatch, name: str) -> None:
        self.lw = lw
        self.name = name
        self.absent = asyncio.Event()  # set once the server said 404

    async def list(self, resource_version: str) -> ListResult:
        try:
            return await self.lw.list(resource_version)
        except ApiError as err:
            if err.status == 403:
                raise SourceError(f"forbidden (403): this agent's ServiceAccount needs list and watch on "
                                  f"servicecidrs (networking.k8s.io, examples/kubernetes/rbac.yaml); only "
                                  f"--service-cidr is checked until then ({err})") from None
            if err.status != 404:
                raise
        log.info("%s: not served by the API server (404); checking --service-cidr only", self.name)
        self.absent.set()
        await asyncio.get_running_loop().create_future()  # never set: wait until cancelled
        raise AssertionError("unreachable")

    def watch(self, resource_version: str, timeout: float) -> AsyncGenerator[WatchEvent, None]:
        return self.lw.watch(resource_version, timeout)


async def list_once(kubeconfig: Path | None) -> list[dict[str, Any]]:
    """One list of Services and EndpointSlices (for `usproxy explain --kubeconfig`), as raw
    objects with their `kind` set, filtered by the same label selector as the reflectors.
    Raises ConfigError for an unusable kubeconfig, SourceError when the server cannot be read."""
    kube_client.load()
    from kubernetes_asyncio.client import ApiClient

    configuration = await client_config(kubeconfig)()
    out: list[dict[str, Any]] = []
    async with ApiClient(configuration) as api:
        api.user_agent = USER_AGENT
        for kind, path in (("Service", SERVICES), ("EndpointSlice", ENDPOINT_SLICES)):
            try:
                result = await ApiListWatch(api, path, label_selector=LABEL_SELECTOR).list("")
            except SourceError as err:
                raise SourceError(f"listing {kind}s: {err}") from None
            except (aiohttp.ClientError, OSError, TimeoutError) as err:
                raise SourceError(f"listing {kind}s: {type(err).__name__}: {err}") from None
            out.extend({**item, "kind": kind} for item in result.items)
    return out
