"""StaleCleanup: when the kernel's stale UDP conntrack entries are cleared, beside the syncs.

The OffloadManager hands it each sync's changes (`queue`); it never holds a sync (with 150,000
UDP entries a cleanup inside the sync held every sync for minutes, issue 18). Two kinds of pass:

- a *full* pass after a full sync (the first one at start included): every UDP entry of every
  UDP ServicePort's frontends is reconciled against the current endpoints (StaleUdp; an
  endpoint removed while the agent was down is caught here, issue 29 item 7);
- a *partial* pass after a sync that changed UDP ServicePorts: the same rule for those
  ServicePorts' frontends only, which the kernel filters for (a dump per frontend: a Service
  with few entries is done in a fraction of a second however many entries others have).

Passes start at once, up to MAX_PASSES at a time, each a child process (KernelConntrack), so a
Service's cleanup never waits behind another's (issue 29 item 8: a second Service's change
waited 69 s); changes queued while every slot is busy are merged into the next pass, whose rule
is read when it starts. Kernel datapaths without DNATed conntrack entries (BPF) get the removed
endpoints instead (`clear_stale`). Known limit: a pass judges by the endpoints of when it
started, so a session that lands on an endpoint added during a pass of its Service may be
deleted once and pick again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from usproxy.core.datapath import ServicePortState, SyncRequest, UdpConntrackReconciler
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import ServicePortName
from usproxy.offload.kernel_conntrack import CLEANUP_PASSES
from usproxy.offload.kernel_datapath import KernelDatapath
from usproxy.core.stale_udp import StaleUdp

log = logging.getLogger(__name__)
MAX_PASSES = CLEANUP_PASSES  # cleanup children at once, each waited for by a thread of its own


@dataclass
class _Pending:
    """What the next pass covers."""

    full: bool = False
    spns: set[ServicePortName] = field(default_factory=set)  # partial: these UDP ServicePorts
    gone: list[ServicePortState] = field(default_factory=list)  # removed UDP ServicePorts
    removed: dict[ServicePortName, frozenset[Endpoint]] = field(default_factory=dict)  # for clear_stale

    def __bool__(self) -> bool:
        return self.full or bool(self.spns or self.gone or self.removed)


class StaleCleanup:
    """`kernels()` gives the usable kernel datapaths, `states()` the current ServicePortStates by
    name, `holds(kernel name, spn)` whether a kernel holds a ServicePort (its removed endpoints
    go to that kernel's clear_stale)."""

    def __init__(self, kernels: Callable[[], Iterable[KernelDatapath]],
                 states: Callable[[], Mapping[ServicePortName, ServicePortState]],
                 holds: Callable[[str, ServicePortName], bool]) -> None:
        self.kernels = kernels
        self.states = states
        self.holds = holds
        self.pending = _Pending()
        self.running: set[asyncio.Task[None]] = set()

    def queue(self, request: SyncRequest, gone: Iterable[ServicePortState]) -> None:
        """Take one sync's changes; `gone` are the states of the ServicePorts it removed."""
        p = self.pending
        p.full |= request.full
        p.spns |= {spn for spn, st in request.changes.items() if st is not None and spn.protocol == "UDP"}
        p.gone += [st for st in gone if st.service_port.protocol == "UDP"]
        for spn, eps in request.removed_endpoints.items():
            p.removed[spn] = p.removed.get(spn, frozenset()) | eps
        self._launch()

    def _launch(self) -> None:
        while self.pending and len(self.running) < MAX_PASSES:
            work, self.pending = self.pending, _Pending()
            task = asyncio.get_running_loop().create_task(self._pass(work))
            self.running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("conntrack cleanup failed: %s", task.exception())
        self._launch()

    async def _pass(self, work: _Pending) -> None:
        rule = self._rule(work)
        for k in self.kernels():
            try:
                if isinstance(k, UdpConntrackReconciler):
                    if rule:
                        await k.reconcile_udp(rule)
                    continue
                mine = {spn: eps for spn, eps in work.removed.items() if self.holds(k.name, spn)}
                if mine:
                    await k.clear_stale(mine)
            except Exception as err:
                log.warning("%s: clearing stale conntrack entries: %s", k.name, err)

    def _rule(self, work: _Pending) -> StaleUdp:
        """The rule of the ServicePorts `work` covers, with their endpoints now."""
        states = self.states()
        if work.full:
            return StaleUdp.of(states.values(), work.gone)
        mine = [states[spn] for spn in work.spns if spn in states]
        return StaleUdp.of(mine, work.gone)

    async def idle(self) -> None:
        """Wait until every queued pass has run (tests; a sync never waits)."""
        while self.running:
            await asyncio.gather(*[asyncio.shield(t) for t in self.running], return_exceptions=True)

    def cancel(self) -> None:
        """Stop (the agent's exit): entries a pass would have deleted expire by themselves."""
        for t in self.running:
            t.cancel()
