"""Relay: the datapath named "userspace" (kube-proxy 1.0's userspace mode, done right).

In code the component is "the relay"; "userspace" is only its datapath name, the one /services,
`usproxy status`, the usproxy.io/datapath annotation and metric labels show (as kube-proxy's mode).

On its first sync it sets up the ClusterIP interface (VipInterface) and finds the node addresses
for NodePorts (NodeFacts.nodeport_ips, as nftables: --nodeport-addresses, default every non-loopback
address outside the ClusterIP interface). Each sync applies only the changed ServicePorts, one ServicePortRelay each;
an error in one is logged and reported in its placement and never stops the others. Addresses
follow the Services: an address stays while any ServicePort uses it, and for RELEASE_AFTER seconds
more (at most MAX_RELEASED such addresses, oldest dropped first), without listeners, so that
clients of a deleted Service are refused by the kernel at once (C21) instead of being routed nowhere
and timing out; an address that is needed again is simply kept. A UDP sweeper expires idle flows
once a second; that sweep also gives freed flow buffers back to the system after many flows
ended (HeapTrim).

A new ServicePort that a kernel datapath serves from this very sync (`kernel_serves`: the offload
manager's serves_at_once, for --offload-after 0) does not wait for its listeners: they open right
after the sync, a batch at a time, so a cold start's kernel step is not queued behind 10,000
listeners (no flow exists yet that one could carry). The sync keeps only such a ServicePort's
state; the opener builds its ServicePortRelay (~0.05 s of a 10,000-Service start's sync). They
still open: the relay stays the fallback under the kernel (a transaction refused later, a table
flushed behind our back). When every
ServicePort a sync brings is such, its frontend addresses are added in the netlink thread while
the sync goes on (the kernel's work, O(n) per address on one interface, overlaps the kernel
datapath's transaction); the deferred listeners wait for them, outside the sync lock, and so
does a later sync that opens a listener itself; a sync that changes a ServicePort still waiting
for its listeners, which the kernel still serves, leaves it waiting and waits for nothing. A sync
and that opener never apply at the same time (`_applying`).

It owns what the ServicePortRelays share and hands it to each through its constructor: the
FlowAdmission (flow bounds and eviction, sized from the descriptor limit), the UdpRelay, the set
of every listening (address, port, protocol) and the ClientOrigin (pods and the node, for the
Local traffic policies).

Where no nftables datapath checks the Service CIDRs (`drop_unallocated`), their unallocated
addresses are blackholed by the routing table (service_cidr_routes.py): the --service-cidr flag's
CIDRs with those of the ServiceCIDR objects (`on_service_cidrs_changed`), applied at the next sync.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import cast

from usproxy.util.gc_pause import LARGE, freeze_heap
from usproxy.util.heap import HeapTrim, give_back_free_heap
from usproxy.util.metrics import Metrics
from usproxy.util.netlink_worker import NetlinkWorker
from usproxy.model.config import ProxyConfig, parse_cidrs
from usproxy.model.service_cidr import union
from usproxy.flows.flow_table import Flow
from usproxy.flows.metrics import FlowTableCollector
from usproxy.core.datapath import Placement, ServicePortState, SyncRequest
from usproxy.model.endpoint import usable
from usproxy.model.node import NodeFacts
from usproxy.relay.client_origin import ClientOrigin
from usproxy.relay.flow_admission import FlowAdmission
from usproxy.relay.port_capture import CaptureMode, PortCapture
from usproxy.relay.service_port_relay import Listening, ServicePortRelay
from usproxy.relay.udp import UdpRelay
from usproxy.relay.vip_interface import VipInterface
from usproxy.model.service_port import LBPolicy
from usproxy.model.types import IPAddress, IPNetwork, ServicePortName, format_hostport
from usproxy.relay import return_route, service_cidr_routes
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)
RELEASE_AFTER = 60.0  # seconds an address no Service uses stays local (refused), covering DNS TTLs
OPEN_BATCH = 64  # deferred ServicePorts whose listeners open between two turns of the loop (~3 ms)
MAX_RELEASED = 1024  # such addresses kept at most


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Go programs do); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


async def _after(first: asyncio.Future[None] | None, then: Awaitable[None]) -> None:
    """`then` after `first` (an add still running); either one's failure fails the whole."""
    try:
        if first is not None:
            await first
    finally:
        await then


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """What the relay takes from the agent's settings: the ClusterIP interface, the default
    lb-policy, the flow bound (kube-proxy's conntrack max rule, ProxyConfig.conntrack_max) and
    the idle timeouts in seconds: UDP flows, established TCP flows and half-closed TCP flows (as
    kube-proxy's conntrack settings give them to the kernel's entries; 0 turns one off)."""

    vip_interface: str
    lb_policy: LBPolicy
    conntrack_max: int
    udp_idle_timeout: float
    tcp_established_timeout: float = 86400.0
    tcp_close_wait_timeout: float = 3600.0
    service_cidrs: tuple[IPNetwork, ...] = ()  # --service-cidr
    capture: CaptureMode = "auto"  # --relay-capture (port_capture.py)

    @classmethod
    def from_config(cls, cfg: ProxyConfig) -> RelaySettings:
        return cls(cfg.vip_interface, cfg.lb_policy, cfg.conntrack_max(), cfg.udp_idle_timeout,
                   cfg.tcp_established_timeout, cfg.tcp_close_wait_timeout,
                   parse_cidrs(cfg.service_cidrs, "--service-cidr"), cast(CaptureMode, cfg.relay_capture))


def _kept_alive(flow: Flow, now: float, timeout: float) -> bool:
    """Whether a flow idle in payload was kept alive by ACKs (TCP keepalive probes answered), as
    they keep a kernel conntrack entry alive: then its activity is moved up to the last ACK."""
    age = flow.liveness() if flow.liveness is not None else None
    if age is None or age >= timeout:
        return False
    flow.last_seen = max(flow.last_seen, now - age)
    return True


def tcp_sweep_period(settings: RelaySettings) -> float:
    """How often idle TCP flows are looked for (seconds): a tenth of the shorter timeout, between
    0.1 s and 10 s, so a flow outlives its timeout by at most a tenth (or 10 s)."""
    timeouts = [t for t in (settings.tcp_established_timeout, settings.tcp_close_wait_timeout) if t > 0]
    return min(10.0, max(0.1, min(timeouts) / 10)) if timeouts else 10.0


class Relay:
    """The relay: a Datapath named "userspace"; `node` gives the NodePort CIDRs."""

    name = "userspace"
    flows_block = False  # its flow table lives on the event loop

    def __init__(self, settings: RelaySettings, node: NodeFacts, metrics: Metrics | None = None,
                 vip: VipInterface | None = None) -> None:
        self.settings = settings
        self.node = node
        self.metrics = metrics or Metrics()
        self.vip = vip or VipInterface(settings.vip_interface)
        self.default_policy: LBPolicy = settings.lb_policy
        self.udp = UdpRelay(settings.udp_idle_timeout)
        self.listening: Listening = set()
        self.admission = FlowAdmission.within(settings.conntrack_max, raise_nofile_limit(), self.udp.evict_oldest,
                                              self.listening, evict_own=self.udp.evict_oldest_of)
        self.metrics.registry.register(FlowTableCollector(self.admission.table))
        self.ports: dict[ServicePortName, ServicePortRelay] = {}
        self.node_ips: list[str] = []
        self.host_ips: set[IPAddress] = set()  # local addresses on other interfaces: never on usproxy0
        # pods and the node, for externalTrafficPolicy Local's short-circuit and drops
        self.origin = ClientOrigin(node.detector, lambda ip: ip in self.host_ips or ip in self.vip.addresses)
        self._sweeper: asyncio.Task[None] | None = None
        self._started = False
        self.released: dict[IPAddress, float] = {}  # unused address -> since when (monotonic)
        self._uses: dict[IPAddress, int] = {}  # address -> ServicePorts with a frontend on it
        self._failing: set[ServicePortName] = set()  # ServicePorts with a listener to retry
        self.heap = HeapTrim.for_glibc()  # freed flow buffers back to the system after flows end
        # unallocated Service CIDR addresses: blackholed unless nftables drops them (the agent says)
        self.drop_unallocated = True
        self.service_cidr_objects: tuple[IPNetwork, ...] = ()  # the ServiceCIDR objects' CIDRs
        self._routed: tuple[IPNetwork, ...] | None = None  # what service_cidr_routes holds (None: unknown)
        # answers to connections from the network with a local source routed out (return_route.py):
        # node-wide state, so only the agent turns it on, never a relay built in a test's own netns
        # its mark bit (--hairpin-mark); 0: off (an earlier agent's table and rules go); None: untouched
        self.return_mark: int | None = None
        self.host_links: set[str] = set()  # the interfaces holding host_ips
        self.returns: return_route.ReturnRoute | None = None  # from the start on, with return_mark
        # per ServicePort with LB IPs: (its LB IP frontends, its other addresses): the hairpins
        self._lb_ips: dict[ServicePortName, tuple[tuple[return_route.Hairpin, ...], tuple[IPAddress, ...]]] = {}
        self._return_watch: asyncio.Task[None] | None = None
        self.capture = PortCapture(settings.capture)
        # Whether a kernel datapath serves a new ServicePort from this very sync (the agent wires
        # the offload manager's serves_at_once): its listeners then open after the sync.
        self.kernel_serves: Callable[[ServicePortState], bool] | None = None
        # ServicePorts the kernel serves whose listeners wait, by their latest state: the opener
        # builds their ServicePortRelays (not the sync, which the kernel step would wait for)
        self._deferred: dict[ServicePortName, ServicePortState] = {}
        self._opener: asyncio.Task[None] | None = None
        self._applying = asyncio.Lock()  # a sync and the deferred opener never apply at once
        self._adding: asyncio.Future[None] | None = None  # addresses added while the sync goes on
        self._readd = False  # that failed: add every frontend address again

    # -- Datapath ------------------------------------------------------------------------------
    async def sync(self, request: SyncRequest) -> None:
        async with self._applying:
            await self._sync(request)
        if self._deferred and (self._opener is None or self._opener.done()):
            self._opener = asyncio.get_running_loop().create_task(self._open_deferred())

    async def _sync(self, request: SyncRequest) -> None:
        first = not self._started
        if first:
            await self._start()
        elif request.full:
            self.node_ips = await self._node_addresses()
        if request.full:  # addresses a previous agent left that nothing claims any more
            now = time.monotonic()
            for ip in self.vip.addresses - self._uses.keys() - self.released.keys():
                self.released[ip] = now
        defer = self._kernel_served(request)
        opens = any(st is not None and spn not in defer for spn, st in request.changes.items())
        if opens:  # a listener opens now: the addresses a sync is adding in the background first
            await self._addresses_added()
            if self._readd:
                await self._readd_addresses()
        # Listeners (bound with IP_FREEBIND) and captures first, addresses after: a frontend's
        # first packet can only arrive once its address is local, and then finds the port held
        # by the relay or captured, never by a node daemon on a wildcard address (issue 29 item 6).
        self._refresh_origin()
        for spn, state in request.changes.items():
            try:
                await self._sync_one(spn, state, spn in defer)
            except Exception:
                log.exception("%s: relay sync failed", spn)
            self._note_lb_ips(spn, state)
        if first:
            self.capture.settle()  # in the background
        adding = self.vip.add_many(ip for st in request.changes.values() if st is not None
                                   for ip, _ in st.service_port.frontends() if ip not in self.host_ips)
        if not opens:
            # nothing this sync brings listens before the kernel step (its frontends' first
            # packets are the kernel's): the kernel adds the addresses (O(n) each on one
            # interface: 1.2 s of its time for 10,000) in the netlink thread while the loop goes on
            # to the kernel datapaths' transaction, after any add still running (the same thread)
            self._adding = asyncio.ensure_future(_after(self._adding, adding))
        else:
            await adding
        await self._sync_addresses()
        await self._sync_service_cidr_routes()
        await self._retry_failed()
        if self.returns is not None:  # made at the start
            await self.returns.update(self._hairpins(), self.host_links, refresh=request.full)
            if self.return_mark and self._return_watch is None:
                self._return_watch = asyncio.get_running_loop().create_task(self.returns.watch())

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        """The ServiceCIDR objects' CIDRs (ServiceCIDRHandler): routed at the next sync."""
        self.service_cidr_objects = cidrs

    async def _sync_service_cidr_routes(self) -> None:
        """Blackhole the Service CIDRs (or nothing, when nftables drops for us); a failure is
        logged and retried at the next sync."""
        want = union(self.settings.service_cidrs, self.service_cidr_objects) if self.drop_unallocated else ()
        if want == self._routed:
            return
        try:
            done = await self.vip.worker.call(lambda ipr: service_cidr_routes.reconcile(ipr, want))
        except Exception as err:
            log.error("routes for the Service CIDRs %s: %s", ", ".join(map(str, want)) or "(none)", err)
            self._routed = None
            return
        self._routed = want
        if done:
            log.info("Service CIDRs routed to a blackhole (unallocated addresses dropped): %s (%s)",
                     ", ".join(map(str, want)) or "none", " ".join(done))

    async def _retry_failed(self) -> None:
        for spn in list(self._failing):
            port = self.ports.get(spn)
            if port is not None:
                await port.retry_failed()
            if port is None or not port.errors:
                self._failing.discard(spn)

    async def _start(self) -> None:
        self.capture.start()  # probes in the background; a capture waits for it
        await self.vip.setup()
        self.node_ips = await self._node_addresses()
        if self.return_mark is not None:  # the agent's relay (None: a test's, in its own netns)
            # a netlink thread of its own: the VIP interface's is busy adding the addresses in
            # the background (1.3 s of the kernel's for 10,000), and the first sync's end, hence
            # the kernel step, waited for it behind them
            self.returns = return_route.ReturnRoute(self.return_mark, NetlinkWorker())
            await self.returns.start()  # --hairpin-mark 0: an earlier agent's go; on: at the sync's end
        log.info("NodePort addresses: %s", ", ".join(self.node_ips) or "none")
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._started = True

    def _note_lb_ips(self, spn: ServicePortName, state: ServicePortState | None) -> None:
        """Keep the LB IP frontends of `spn` (and its other addresses) for the hairpin table."""
        sp = state.service_port if state is not None else None
        if sp is not None and sp.load_balancer_ips:
            self._lb_ips[spn] = (tuple((ip, sp.protocol, sp.port) for ip in sp.load_balancer_ips),
                                 (*sp.cluster_ips, *sp.external_ips))
        else:
            self._lb_ips.pop(spn, None)

    def _hairpins(self) -> set[return_route.Hairpin]:
        """The LB IP frontends a load balancer may hairpin: not an LB IP that is also one of the
        node's own addresses, a ClusterIP or an externalIP (a Service status naming one must
        not open the table for that address as a source)."""
        taken = self.host_ips | {ip for _, others in self._lb_ips.values() for ip in others}
        return {fe for frontends, _ in self._lb_ips.values() for fe in frontends if fe[0] not in taken}

    def _kernel_served(self, request: SyncRequest) -> set[ServicePortName]:
        """The new ServicePorts of `request` a kernel datapath serves from this sync on."""
        serves = self.kernel_serves
        if serves is None:
            return set()
        return {spn for spn, st in request.changes.items()
                if st is not None and (spn not in self.ports or spn in self._deferred) and serves(st)}

    async def _readd_addresses(self) -> None:
        """After a failed background add: every frontend address again (EEXIST counts as added)."""
        states = (*(port.state for port in self.ports.values()), *self._deferred.values())
        await self.vip.add_many(ip for st in states for ip, _ in st.service_port.frontends() if ip not in self.host_ips)
        self._readd = False

    async def _addresses_added(self) -> None:
        """Wait for the addresses a previous sync is adding in the background (any number of
        waiters: the deferred listeners' opener waits without the sync lock); when that failed,
        log it and add them all again before the next listener opens."""
        task = self._adding
        if task is None:
            return
        await asyncio.wait([task])  # a cancelled waiter leaves the add running
        if self._adding is not task:
            return  # another waiter took it
        self._adding = None
        if not task.cancelled() and task.exception() is not None:
            log.error("adding frontend addresses to %s: %s; adding them again", self.vip.name, task.exception())
            self._readd = True

    async def _sync_one(self, spn: ServicePortName, state: ServicePortState | None, defer: bool = False) -> None:
        port = self.ports.get(spn)
        waiting = self._deferred.pop(spn, None)
        self._count_addresses(port.state if port is not None else waiting, state)
        if state is None:
            if port is not None:
                del self.ports[spn]
                await port.close()
            return
        if defer:  # the kernel serves it now (new, or still waiting): its listeners after the sync
            self._deferred[spn] = state
            return
        if port is None:
            port = self.ports[spn] = self._new_port(state)
        await port.apply(state, self.node_ips)
        if port.errors:
            self._failing.add(spn)

    def _new_port(self, state: ServicePortState) -> ServicePortRelay:
        return ServicePortRelay(state, admission=self.admission, udp=self.udp, listening=self.listening,
                                default_policy=self.default_policy, origin=self.origin, capture=self.capture)

    def _count_addresses(self, old: ServicePortState | None, new: ServicePortState | None) -> None:
        """Reference counts of frontend addresses; an address nobody uses goes to `released`."""
        was = old.service_port.frontends() if old is not None else ()
        now = new.service_port.frontends() if new is not None else ()
        if was == now:  # an endpoint change: nothing to count (and no address hashed)
            return
        before = {ip for ip, _ in was}
        after = {ip for ip, _ in now}
        uses, released = self._uses, self.released
        for ip in after - before if before else after:
            uses[ip] = uses.get(ip, 0) + 1
            if released:
                released.pop(ip, None)
        for ip in before - after:
            self._uses[ip] -= 1
            if not self._uses[ip]:
                del self._uses[ip]
                self.released[ip] = time.monotonic()

    async def _sync_addresses(self) -> None:
        """Remove released addresses after RELEASE_AFTER seconds, keeping at most MAX_RELEASED."""
        if not self.released:
            return
        now = time.monotonic()
        by_age = sorted(self.released, key=lambda a: self.released[a])
        drop = by_age[:max(0, len(by_age) - MAX_RELEASED)]
        drop += [ip for ip in by_age[len(drop):] if now - self.released[ip] >= RELEASE_AFTER]
        for ip in drop:
            del self.released[ip]
            await self.vip.remove(ip)

    async def _node_addresses(self) -> list[str]:
        """NodePort addresses (NodeFacts.nodeport_ips, the rule the nftables datapath follows
        too); also refreshes `host_ips`, the addresses other interfaces hold."""
        local = await self.vip.local_addresses()
        self.host_ips = {ip for ifname, ip in local if ifname != self.vip.name}
        self.host_links = {ifname for ifname, _ in local if ifname not in (self.vip.name, "lo")}
        return sorted(str(ip) for ip in self.node.nodeport_ips(local, self.vip.name))

    async def _open_deferred(self) -> None:
        """Open the deferred listeners, OPEN_BATCH ServicePorts at a time with the loop running in
        between; a sync that comes meanwhile goes first, and opens those it changes that the
        kernel no longer serves."""
        opened = 0
        try:
            while self._deferred:
                while self._adding is not None:  # a listener binds only to an address that is there;
                    await self._addresses_added()  # waited for without the lock: syncs go on meanwhile
                async with self._applying:
                    if self._readd:
                        await self._readd_addresses()
                    for _ in range(min(OPEN_BATCH, len(self._deferred))):
                        spn, state = self._deferred.popitem()
                        port = self.ports[spn] = self._new_port(state)
                        await port.apply(state, self.node_ips)
                        opened += 1
                        if port.errors:
                            self._failing.add(spn)
                await asyncio.sleep(0)
            if opened >= LARGE:  # listeners live as long as their ServicePort: out of the collector's
                freeze_heap()  # full passes, as a large sync's state (a cold start's 10,000: 0.25 s each)
            await give_back_free_heap()  # what opening them freed (a cold start's 10,000: ~5 MiB)
        except Exception:
            log.exception("opening deferred listeners failed; the next sync retries")

    def placement(self, spn: ServicePortName) -> Placement | None:
        if spn in self._deferred:
            return Placement("userspace", "served by the kernel; the relay's listeners open after the kernel step")
        port = self.ports.get(spn)
        if port is None:
            return None
        if port.errors:
            return Placement("userspace", "; ".join(sorted(set(port.errors.values()))), error=True)
        listening = ", ".join(sorted(format_hostport(a, p) + (f" ({port.captured[(a, p, k)]})" if (a, p, k) in port.captured
                                                              else "") for a, p, k in port.listeners))
        reason = f"listening on {listening}" if listening else "no usable endpoints: refused by the kernel"
        return Placement("userspace", "; ".join([reason, *local_policy_notes(port.state)]))

    def dump(self) -> str:
        lines = [f"interface {self.vip.name} ({self.vip.kind}): "
                 + " ".join(sorted(str(ip) for ip in self.vip.addresses))]
        for spn in sorted(self.ports.keys() | self._deferred.keys()):
            port = self.ports.get(spn)
            state = port.state if port is not None else self._deferred[spn]
            ls = " ".join(f"{format_hostport(a, p)}[{k}]" for a, p, k in sorted(port.listeners)) if port else ""
            eps = " ".join(str(e) for e in state.cluster_endpoints) or "<none>"
            lines.append(f"{spn.key()} listen {ls or '<none>'} -> {eps}")
        return "\n".join(lines)

    def flows_view(self) -> list[FlowRow]:
        return self.admission.table.view()

    def flows_chunks(self, size: int) -> Iterator[list[FlowRow]]:
        """flows_view() in chunks of `size` rows (the agent's ChunkedFlowsView)."""
        return self.admission.table.view_chunks(size)

    async def close(self) -> None:
        """Stop relaying (the agent's exit): refuse new flows (a connection the loop accepted but
        hands to its protocol only later is reset, not relayed into the exit's FIN), reset every
        relayed TCP connection on both legs, close the listeners and UDP flows, give up the VIP
        interface's addresses."""
        for task in (self._sweeper, self._opener, self._return_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._adding is not None:  # the netlink thread finishes it; the interface is closed after
            await asyncio.gather(self._adding, return_exceptions=True)
        await self.capture.close()
        for port in self.ports.values():
            port.stop()  # a connection accepted but not yet handed over must not start a flow now
        self.reset_tcp_flows()
        for port in list(self.ports.values()):
            await port.close(keep_capture=True)  # captures refuse while no agent runs
        self.ports.clear()
        for uf in list(self.udp.flows.values()):
            self.udp.close_flow(uf)
        self.origin.close()
        if self.returns is not None:
            self.returns.close()
        if self._started:
            await self.vip.close()

    # -- flows ---------------------------------------------------------------------------------
    async def _sweep(self) -> None:
        tcp_every = tcp_sweep_period(self.settings)
        next_tcp = time.monotonic() + tcp_every
        while True:
            await asyncio.sleep(min(1.0, max(0.1, self.settings.udp_idle_timeout / 4), tcp_every))
            try:
                self.udp.expire()
                if time.monotonic() >= next_tcp:
                    self.expire_tcp()
                    self.settle_tcp()
                    next_tcp = time.monotonic() + tcp_every
                if self._readd:
                    async with self._applying:
                        await self._readd_addresses()
                # Not under `_applying`: a failed bind's holder is looked up in /proc (seconds on a
                # busy node), and a sync must not wait for that. A port retried here is one whose
                # apply already ran (the opener never holds one that is failing).
                await self._retry_failed()  # a listener address freed by someone else: take it
                self._refresh_origin()
                await self.heap.tick(len(self.admission.table))
            except Exception:
                log.exception("flow sweep failed")

    def _refresh_origin(self) -> None:
        """Pod interfaces come and go (an interface detector): filters that let pods through follow."""
        try:
            changed = self.origin.refresh()
        except OSError as err:
            log.warning("reading interfaces for the local-traffic detector: %s", err)
            return
        if changed:
            for port in self.ports.values():
                port.refilter()

    def settle_tcp(self) -> int:
        """Run the deferred set-up (`Flow.settle`) of every TCP flow still live at this sweep: the
        endpoint leg's SO_KEEPALIVE (tcp.py), which costs a Python socket object and a syscall per
        connection if done at connect and matters only after tcp_keepalive_time (2 h by default)
        of silence; a sweep period (at most 10 s) late loses nothing. Returns how many ran."""
        pending = [f for f in self.admission.table if f.settle is not None]
        for f in pending:
            settle, f.settle = f.settle, None
            assert settle is not None
            settle()
        return len(pending)

    def reset_tcp_flows(self) -> int:
        """Reset every relayed TCP connection on both legs (SO_LINGER 0, so even the process's exit
        right after sends RST): a stream the relay stops carrying must not look complete. Closed
        with FIN, a client without its own length framing (HTTP/1.0, a download to EOF) would take
        a cut stream for the whole one. Returns how many flows were reset."""
        flows = [f for f in self.admission.table if f.protocol == "TCP" and f.closer is not None]
        for f in flows:
            assert f.closer is not None
            f.closer()
        if flows:
            log.info("reset %d relayed TCP connections: the relay stops", len(flows))
        return len(flows)

    def expire_tcp(self, now: float | None = None) -> int:
        """Reset relayed TCP flows idle past their timeout: established ones after
        `tcp_established_timeout`, half-closed ones (FIN_WAIT: one side sent FIN) after
        `tcp_close_wait_timeout` (as the kernel expires kube-proxy's conntrack entries). Returns how
        many were reset; O(flows), run every `tcp_sweep_period`."""
        now = time.monotonic() if now is None else now
        est, half = self.settings.tcp_established_timeout, self.settings.tcp_close_wait_timeout
        expired = [f for f in self.admission.table if f.protocol == "TCP" and f.closer is not None and (
            (f.state == "FIN_WAIT" and half and now - f.last_seen > half)
            or (f.state == "ESTABLISHED" and est and now - f.last_seen > est))]
        expired = [f for f in expired if not _kept_alive(f, now, half if f.state == "FIN_WAIT" else est)]
        for f in expired:
            assert f.closer is not None
            f.closer()
        if expired:
            self.admission.table.timed_out += len(expired)
            log.info("reset %d relayed TCP flows idle past their timeout", len(expired))
        return len(expired)



def local_policy_notes(state: ServicePortState) -> list[str]:
    """What the relay does for a Local traffic policy that leaves no local endpoint while the
    Service has endpoints elsewhere, for /services: it drops as kube-proxy drops (the listener's
    socket filter), pods and the node excepted for externalTrafficPolicy Local, which go to every
    endpoint (kube-proxy's short-circuit)."""
    sp = state.service_port
    if not usable(state.endpoints):
        return []
    notes = []
    if not state.cluster_endpoints:
        notes.append("internalTrafficPolicy Local without a local endpoint: ClusterIP connections dropped")
    if (sp.node_port or sp.external_ips_all()) and sp.external_traffic_policy == "Local" \
            and not state.external_endpoints:
        notes.append("externalTrafficPolicy Local without a local endpoint: outside clients dropped, "
                     "pods and the node sent to every endpoint")
    return notes
