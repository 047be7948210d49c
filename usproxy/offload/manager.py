"""OffloadManager: decides which ServicePorts the kernel serves, and keeps the kernel in step.

A Datapath (name "offload") synced after the relay. Per ServicePort it tracks when its usable
endpoint set last changed; once that set has been stable for `--offload-after` seconds and a
kernel datapath is available, allowed (`--offload auto|nftables|bpf`, annotation
usproxy.io/datapath) and able to serve it, the ServicePort is *established* and installed in the
kernel. From then on endpoint changes are applied to the kernel as diffs; the relay keeps its
listener as the fallback and drains the flows it already has.

Kernel datapaths are chosen per traffic kind: BPF serves only locally originated connections,
nftables both, so `auto` with both available installs a ServicePort in BPF (local) and nftables
(forwarded). Each kernel datapath gets one transaction per sync. A refused transaction is split
in halves until the failing ServicePorts are found; those are *demoted*: removed from the kernel
and served by the relay, with the reason in /services, `usproxy status`, the log and the metric
usproxy_offload_demotions. They are retried after another window. Each ServicePort's phase and
the faults that keep it in the relay are values (reason.py), worded only for those outputs.
What each kernel datapath has sent to the kernel (KernelWriteCounter) is the metric
usproxy_kernel_writes_total{datapath, unit}, read at scrape time.

On the first (full) sync after start, what the kernel holds is read back: ServicePorts installed
and still wanted stay offloaded at once and only differences are applied (field case C20);
ServicePorts no longer wanted are removed. Before that first sync (the source has not listed) the
kernel is left alone, and `close()` never flushes it: only `usproxy run --cleanup` does
(cleanup.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.core import CounterMetricFamily

from usproxy.core.events import EventHub
from usproxy.util.metrics import Metrics
from usproxy.model.types import IPNetwork
from usproxy.core.datapath import KernelWriteCounter, Placement, ServiceCIDRHandler, ServicePortState, SyncRequest
from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import OffloadError
from usproxy.offload import external_route, registry
from usproxy.offload.kernel_datapath import ALL_TRAFFIC, Capability, KernelDatapath, KernelDatapathDeclaration
from usproxy.offload.settings import OffloadSettings
from usproxy.offload.stale_cleanup import StaleCleanup
from usproxy.offload.reason import ESTABLISHED, ESTABLISHING, NO_DATAPATH, PINNED, REMOVED, Cause, Fault, Phase, Reason
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

Changes = dict[ServicePortName, ServicePortState | None]


@dataclass
class _Port:
    """The manager's view of one ServicePort."""

    state: ServicePortState
    usable: frozenset[tuple[IPAddress, int]]
    since: float  # when `usable` last changed, or the last demotion
    kernels: tuple[str, ...] = ()  # kernel datapaths holding it now
    established_at: float = 0.0
    reason: Reason = ESTABLISHING  # its phase, and why it is (still) in the relay
    refused: Fault | None = None  # the last refused transaction, until the next window passes
    dirty: bool = True  # state changed since the kernels last got it


@dataclass
class _Plan:
    changes: dict[str, Changes] = field(default_factory=dict)
    targets: dict[ServicePortName, tuple[str, ...]] = field(default_factory=dict)


_NO_WINDOW: frozenset[tuple[IPAddress, int]] = frozenset()


def usable_key(state: ServicePortState) -> frozenset[tuple[IPAddress, int]]:
    """What the window watches: the addresses of the endpoints traffic can reach."""
    return frozenset(ep.address for ep in (*state.cluster_endpoints, *state.external_endpoints,
                                          *state.short_circuit_endpoints))


class OffloadManager:
    """The offload layer over a list of KernelDatapaths (in order of preference).

    `request_sync` asks for a sync when a ServicePort's window ends (the agent passes the
    Proxier's, which does not count it as a source change)."""

    name = "offload"
    flows_block = True  # flows_view dumps kernel state: call it off the event loop

    def __init__(self, settings: OffloadSettings, kernels: Sequence[KernelDatapath] = (), *,
                 request_sync: Callable[[], None], metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, events: EventHub | None = None,
                 declared: Mapping[str, KernelDatapathDeclaration] | None = None) -> None:
        """`events`: where offloads and demotions are published as they happen (the web view);
        `declared`: the kernel datapaths' declarations by name (default: the registry's), whose
        LB policies placement checks."""
        self.declared = declared if declared is not None else registry.BY_NAME
        self.default_policy = settings.lb_policy
        self.offload_after = settings.offload_after
        self.events = events
        self.metrics = metrics or Metrics()
        self.kernels = list(kernels)
        self.clock = clock
        self.request_sync = request_sync
        self.ports: dict[ServicePortName, _Port] = {}
        self.capabilities: dict[str, Capability] = {}
        self._usable: list[KernelDatapath] | None = None
        self._probe_lock = threading.Lock()
        self._waiting: set[ServicePortName] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.stale = StaleCleanup(self.usable_kernels, self._live_states,
                                  lambda k, spn: spn not in self.ports or k in self.ports[spn].kernels)
        self._timer_due = 0.0
        self._covering: dict[tuple[str, ...], bool] = {}  # kernel datapaths -> whether they serve all traffic
        self.metrics.registry.register(_KernelWritesCollector(self.kernels))

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        """The ServiceCIDR objects' CIDRs changed: told to every kernel datapath that checks them
        (the caller, the Proxier, makes the next sync a full one)."""
        for k in self.kernels:
            if isinstance(k, ServiceCIDRHandler):
                k.on_service_cidrs_changed(cidrs)

    # -- kernels -------------------------------------------------------------------------------
    def usable_kernels(self) -> list[KernelDatapath]:
        """Kernel datapaths that probed available (probed once, on first use), but one that
        conflicts with a better one that did (its declaration says why they cannot share a node).
        The list appears whole or not at all: /flows calls flows_view from a worker thread, and a
        sync that read a list still being probed placed every ServicePort in the relay for good
        (the VM lab's cgroup1 scenario, once: "demoted: bpf unavailable" beside a usable nftables)."""
        with self._probe_lock:
            if self._usable is None:
                self._usable = self._probe_kernels()
            return self._usable

    def _probe_kernels(self) -> list[KernelDatapath]:
        usable: list[KernelDatapath] = []
        for k in self.kernels:
            cap = k.probe()
            clash = next((u.name for u in usable if self._conflict(u.name, k.name)), None)
            if cap.available and clash is not None:
                cap = Capability(k.name, False, f"{clash} serves here, and {k.name} writes kernel state of the "
                                                f"same names (kube-proxy runs one mode per node)")
            self.capabilities[k.name] = cap
            log.info("kernel datapath %s: %s (%s)", k.name, "available" if cap.available else "unavailable", cap.detail)
            if cap.available:
                usable.append(k)
        return usable

    def _conflict(self, a: str, b: str) -> bool:
        da, db = self.declared.get(a), self.declared.get(b)
        return (da is not None and b in da.conflicts) or (db is not None and a in db.conflicts)

    def leave_out(self, name: str, why: str) -> None:
        """Take the kernel datapath `name` out of the ladder before the first sync (the agent:
        its declared lock is held by another agent under `--offload auto`); placements say why."""
        for k in [k for k in self.kernels if k.name == name]:
            self.kernels.remove(k)
            k.close()
        self.capabilities[name] = Capability(name, False, why)

    def _kernel(self, name: str) -> KernelDatapath:
        return next(k for k in self.kernels if k.name == name)

    def _unavailable(self, wanted: str | None) -> tuple[Fault, ...]:
        """Why no kernel datapath (of the `wanted` kind, None: any) is usable here."""
        faults = tuple(Fault(c.name, Cause.UNAVAILABLE, c.detail) for c in self.capabilities.values()
                       if not c.available and wanted in (None, c.name))
        return faults or (Fault(wanted or NO_DATAPATH, Cause.ABSENT),)

    # -- Datapath ------------------------------------------------------------------------------
    async def sync(self, request: SyncRequest) -> None:
        """Track changes, promote what is established, apply one transaction per kernel."""
        now = self.clock()
        # Every full sync reads the kernel back: at start to adopt what a previous agent left,
        # later to repair what was changed behind our back (a deleted table, lost elements).
        installed = await self._read_back() if request.full else {}
        gone = [self.ports[s].state for s, st in request.changes.items() if st is None and s in self.ports]
        self._track(request, now)
        plan = self._plan(now, installed)
        await self._apply(plan, now)
        self.stale.queue(request, gone)  # beside the syncs, never in one
        self._schedule(now)

    def _track(self, request: SyncRequest, now: float) -> None:
        for spn, st in request.changes.items():
            port = self.ports.get(spn)
            if st is None:
                if port is not None:
                    port.dirty, port.reason = True, REMOVED
                    self._waiting.add(spn)
                continue
            key = usable_key(st) if self.offload_after > 0 else _NO_WINDOW  # nothing to watch without one
            if port is None:
                self.ports[spn] = _Port(st, key, now)
            else:
                if key != port.usable:
                    port.usable, port.since = key, now
                port.state, port.dirty = st, True
                if port.reason.phase is Phase.REMOVED:  # back before its removal was applied
                    port.reason = ESTABLISHING
            self._waiting.add(spn)

    async def _read_back(self) -> dict[str, dict[ServicePortName, tuple[Endpoint, ...]]]:
        out = {}
        for k in self.usable_kernels():
            try:
                out[k.name] = await k.read_back()
            except Exception as err:
                log.error("reading back %s: %s; it will be rebuilt", k.name, err)
                out[k.name] = {}
            log.info("read back %d ServicePorts from %s", len(out[k.name]), k.name)
        return out

    # -- planning ------------------------------------------------------------------------------
    def choose(self, port: _Port, now: float) -> tuple[tuple[str, ...], Reason, bool]:
        """The kernel datapaths that should hold `port` now and its reason (ESTABLISHED when
        they are not empty); and whether a reason to stay in the relay ends when its window
        passes."""
        sp = port.state.service_port
        if sp.datapath == "userspace":
            return (), PINNED, False
        kernels = [k for k in self.usable_kernels() if sp.datapath in (None, k.name)]
        if not kernels:
            return (), Reason(Phase.DEMOTED, self._unavailable(sp.datapath)), False
        picked: list[str] = []
        faults: list[Fault] = []
        needed = set(ALL_TRAFFIC)
        for k in kernels:
            if not k.traffic & needed:
                continue
            why = self._unsupported(k, port.state)
            if why is not None:
                faults.append(Fault(k.name, Cause.UNSUPPORTED, why))
                continue
            picked.append(k.name)
            needed -= k.traffic
        if not picked:
            return (), Reason(Phase.DEMOTED, tuple(faults)), False
        if port.kernels or now - port.since >= self.offload_after:
            return tuple(picked), ESTABLISHED, False
        if port.refused is not None:
            return (), Reason(Phase.DEMOTED, (port.refused,)), True
        return (), ESTABLISHING, True

    def _unsupported(self, k: KernelDatapath, state: ServicePortState) -> str | None:
        """Why `k` cannot serve `state`: an LB policy its declaration does not list (the
        ServicePort's usproxy.io/lb-policy, else --lb-policy), or the datapath's own answer."""
        policy = state.service_port.lb_policy or self.default_policy
        declaration = self.declared.get(k.name)
        gap = f"{k.name} declares no LB policies" if declaration is None else declaration.policy_gap(policy)
        return gap or k.unsupported(state)

    def serves_at_once(self, state: ServicePortState) -> bool:
        """Whether kernel datapaths will serve every traffic kind of `state`'s ServicePort from
        the sync that brings it (no window to wait: --offload-after 0, or it is in the kernel
        already), so the relay, synced first, need not open its listeners before the kernel
        step (Relay.kernel_serves). A transaction refused later changes nothing: the relay opens
        them right after the sync either way."""
        now = self.clock()
        port = self.ports.get(state.service_port.name)
        if port is None:
            if self.offload_after > 0:
                return False
            port = _Port(state, frozenset(), now)  # choose() reads neither `usable` nor more
        else:
            port = replace(port, state=state)
        kernels, reason, _ = self.choose(port, now)
        if reason is not ESTABLISHED:
            return False
        covers = self._covering.get(kernels)
        if covers is None:
            covers = self._covering[kernels] = self._covers(kernels)
        return covers

    def _plan(self, now: float, installed: Mapping[str, Mapping[ServicePortName, tuple[Endpoint, ...]]]) -> _Plan:
        plan = _Plan()
        for kname, spns in installed.items():
            for spn in spns:
                self._adopt(kname, spn, now, plan)
        for spn in list(self._waiting):
            self._plan_port(spn, now, plan)
        return plan

    def _adopt(self, kname: str, spn: ServicePortName, now: float, plan: _Plan) -> None:
        """A ServicePort found in the kernel at start: keep it there if it is still wanted."""
        port = self.ports.get(spn)
        if port is not None and port.reason.phase is not Phase.REMOVED:
            port.since = min(port.since, now - self.offload_after)
            if kname in self.choose(port, now)[0]:
                if kname not in port.kernels:  # adopted at start; a later read back keeps the age
                    port.established_at = now
                port.kernels = tuple(sorted({*port.kernels, kname}))
                port.dirty = True
                self._waiting.add(spn)
                return
        plan.changes.setdefault(kname, {})[spn] = None

    def _plan_port(self, spn: ServicePortName, now: float, plan: _Plan) -> None:
        port = self.ports[spn]
        removed = port.reason.phase is Phase.REMOVED
        target, reason, waits = ((), REMOVED, False) if removed else self.choose(port, now)
        for kname in set(target) | set(port.kernels):
            if kname not in target:
                plan.changes.setdefault(kname, {})[spn] = None
            elif kname not in port.kernels or port.dirty:
                plan.changes.setdefault(kname, {})[spn] = port.state
        plan.targets[spn] = target
        if not waits:
            self._waiting.discard(spn)
        if reason.phase is Phase.DEMOTED and not waits and reason != port.reason:
            log.info("%s stays in userspace: %s", spn.key(), reason.text())
            self._count_demotion(reason.faults)
            self._publish("demoted", spn, "userspace", reason.text())
        port.reason = reason

    # -- applying ------------------------------------------------------------------------------
    async def _apply(self, plan: _Plan, now: float) -> None:
        failed: dict[ServicePortName, Fault] = {}
        done: dict[str, set[ServicePortName]] = {}
        for kname, changes in plan.changes.items():
            done[kname], errors = await self._apply_kernel(self._kernel(kname), changes)
            failed.update(errors)
        offloaded: list[str] = []
        for spn, target in plan.targets.items():
            self._settle(spn, target, done, failed, now, offloaded)
        _log_offloaded(offloaded)
        for spn, fault in failed.items():
            await self._demote(spn, fault, now)

    async def _apply_kernel(self, k: KernelDatapath, changes: Changes) -> tuple[set[ServicePortName], dict[ServicePortName, Fault]]:
        """Apply in one transaction; on failure bisect to find the ServicePorts that fail."""
        if not changes:
            return set(), {}
        try:
            await k.apply(changes)
            return set(changes), {}
        except OffloadError as err:
            if len(changes) == 1:
                return set(), {spn: Fault(k.name, Cause.REFUSED, err.message, err.errno) for spn in changes}
            log.warning("%s: transaction of %d ServicePorts refused (%s); bisecting", k.name, len(changes), err)
        items = list(changes.items())
        half = len(items) // 2
        ok_a, err_a = await self._apply_kernel(k, dict(items[:half]))
        ok_b, err_b = await self._apply_kernel(k, dict(items[half:]))
        return ok_a | ok_b, {**err_a, **err_b}

    def _settle(self, spn: ServicePortName, target: tuple[str, ...], done: Mapping[str, set[ServicePortName]],
                failed: Mapping[ServicePortName, Fault], now: float, offloaded: list[str]) -> None:
        port = self.ports[spn]
        before = port.kernels
        if spn in failed:  # _demote removes it from every kernel that may hold it
            port.kernels = tuple(sorted({*before, *(k for k in target if spn in done.get(k, ()))}))
            return
        port.kernels, port.dirty = target, False
        if target and not before:
            port.established_at, port.refused = now, None
            offloaded.append(f"{spn.key()} offloaded to {'+'.join(target)}")
            self._publish("offloaded", spn, "+".join(target), "established")
        elif before and not target and port.reason.phase is not Phase.REMOVED:
            self._publish("userspace", spn, "userspace", port.reason.text())
        if port.reason.phase is Phase.REMOVED:
            del self.ports[spn]
            self._waiting.discard(spn)

    async def _demote(self, spn: ServicePortName, fault: Fault, now: float) -> None:
        """Send a ServicePort back to the relay after a refused transaction."""
        port = self.ports.get(spn)
        if port is None:
            return
        log.warning("%s demoted to userspace: %s", spn.key(), fault.text())
        self._count_demotion((fault,))
        for kname in port.kernels:
            try:
                await self._kernel(kname).apply({spn: None})
            except OffloadError as err:
                log.error("removing %s from %s after a failure: %s", spn.key(), kname, err)
                continue
        port.kernels, port.refused, port.since = (), fault, now
        port.reason, port.dirty = Reason(Phase.DEMOTED, (fault,)), True
        self._waiting.add(spn)
        self._publish("demoted", spn, "userspace", port.reason.text())

    def _publish(self, kind: str, spn: ServicePortName, datapath: str, text: str) -> None:
        """Tell the web view (if any) that `spn` changed datapath; never blocks."""
        if self.events is not None:
            self.events.publish(kind, servicePortName=str(spn), datapath=datapath, reason=text)

    def _count_demotion(self, faults: tuple[Fault, ...]) -> None:
        for f in faults:
            self.metrics.demotions.labels(f.datapath, f.cause.label).inc()

    def _live_states(self) -> dict[ServicePortName, ServicePortState]:
        return {spn: p.state for spn, p in self.ports.items() if p.reason.phase is not Phase.REMOVED}

    async def stale_cleared(self) -> None:
        """Wait until every queued conntrack cleanup has run (tests; a sync never waits)."""
        await self.stale.idle()

    def _schedule(self, now: float) -> None:
        """Wake the sync when the next waiting ServicePort's window ends."""
        due = [self.ports[s].since + self.offload_after for s in self._waiting if s in self.ports]
        due = [d for d in due if d > now]
        if not due:
            return
        when = min(due)
        if self._timer is not None and not self._timer.cancelled() and self._timer_due <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = when
        self._timer = asyncio.get_running_loop().call_later(when - now + 0.01, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self.request_sync()

    # -- views -----------------------------------------------------------------------------------
    def placement(self, spn: ServicePortName) -> Placement | None:
        port = self.ports.get(spn)
        if port is None or port.reason.phase is Phase.REMOVED:
            return None
        now = self.clock()
        if port.kernels:
            note = "" if self._covers(port.kernels) else "; forwarded traffic via userspace"
            return Placement("+".join(port.kernels), f"established {now - port.established_at:.1f}s ago{note}")
        return Placement("userspace", port.reason.text(waited=now - port.since, window=self.offload_after))

    def external_placement(self, spn: ServicePortName) -> Placement | None:
        """Which datapath serves `spn`'s traffic from outside the node, and why
        (usproxy.offload.external_route); None for a ServicePort without external frontends."""
        port = self.ports.get(spn)
        if port is None or port.reason.phase is Phase.REMOVED:
            return None
        placed = [self._kernel(n) for n in port.kernels]
        waited = self.clock() - port.since
        why = "" if placed else f"not offloaded ({port.reason.text(waited=waited, window=self.offload_after)})"
        return external_route.route(port.state, placed, why)

    def _covers(self, names: tuple[str, ...]) -> bool:
        kinds: set[str] = set()
        for n in names:
            kinds |= self._kernel(n).traffic
        return ALL_TRAFFIC <= kinds

    def flows_view(self) -> list[FlowRow]:
        out: list[FlowRow] = []
        for k in self._usable or ():  # before the first sync's probes, no kernel holds a flow of ours
            out.extend(k.flows_view())
        return out

    def dump(self) -> str:
        lines = []
        for spn in sorted(self.ports):
            port, p = self.ports[spn], self.placement(spn)
            if p is not None:
                phase = Phase.ESTABLISHED if port.kernels else port.reason.phase
                lines.append(f"{spn.key()} {p.datapath} ({phase.value})")
        for k in self.kernels:
            text = k.dump()
            if text:
                lines += [f"[{k.name}]", text]
        return "\n".join(lines)

    async def close(self) -> None:
        """Stop timers and threads. Kernel state stays: a restarted agent adopts it (C20)."""
        if self._timer is not None:
            self._timer.cancel()
        self.stale.cancel()  # entries it would have deleted expire by themselves
        for k in self.kernels:
            k.close()


LOGGED_ONE_BY_ONE = 20  # offloads in one sync logged a line each; more make one line (a cold start's 10,000)


def _log_offloaded(lines: list[str]) -> None:
    if len(lines) <= LOGGED_ONE_BY_ONE:
        for line in lines:
            log.info("%s", line)
        return
    log.info("%d ServicePorts offloaded (%s, ...)", len(lines), "; ".join(lines[:3]))
    for line in lines:
        log.debug("%s", line)


class _KernelWritesCollector:
    """usproxy_kernel_writes_total{datapath, unit}: what each kernel datapath has sent to the
    kernel, in its own unit (KernelWriteCounter), read from the datapaths at scrape time."""

    def __init__(self, kernels: Sequence[KernelDatapath]) -> None:
        self.kernels = kernels

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("usproxy_kernel_writes", "What each kernel datapath sent to the kernel, "
                                     "in its own unit", labels=["datapath", "unit"])
        for k in self.kernels:
            if isinstance(k, KernelWriteCounter):
                family.add_metric([k.name, k.write_unit], k.kernel_writes())
        yield family
