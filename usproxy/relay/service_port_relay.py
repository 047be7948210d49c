"""ServicePortRelay: the relay's runtime state for one ServicePort.

It owns the listeners of that ServicePort (ClusterIPs and external IPs on `port`, node addresses
on the NodePort; TCP or UDP by the ServicePort's protocol) and one EndpointSelector per traffic
kind ("cluster" for ClusterIPs, "external" for NodePorts, externalIPs and LoadBalancer IPs, which
obey externalTrafficPolicy), and it is the FlowOwner of every flow its listeners relay. A frontend
listens only while its kind has a usable endpoint, so the kernel refuses at once otherwise (C01,
C03); a connection accepted just before its listener closed is reset, never left hanging
(TcpListener). `apply()` diffs listeners by (address, port, protocol) and touches nothing that did
not change (C21); after it, no UDP flow points at an endpoint outside its kind's usable set.
A frontend that cannot be bound because another local socket holds its port (a node daemon on
0.0.0.0:P: port_holder.py says why the relay cannot share it) is captured (port_capture.py): a
listener on the same address and a port of the kernel's choosing gets the frontend's traffic
through a DNAT that runs before the socket lookup, so the holder never sees it; the frontend
stays captured while it listens (its flows' NAT points there), and while its Service has no
endpoint it is refused rather than left to the holder. Where no capture mechanism works, such a
frontend is reported in `errors` naming the holder, logged once per change of cause, and retried
until it binds or is no longer wanted.

Where kube-proxy drops, the listener's socket filter drops (source_filter.py: the kernel drops a
SYN or datagram before any answer, so the client times out as against kube-proxy's DROP):
- a LoadBalancer IP with loadBalancerSourceRanges drops clients outside them, and `new_flow`
  refuses such a client should one get through (NodePorts are not filtered, as kube-proxy);
- internalTrafficPolicy Local without a local endpoint (while the Service has endpoints
  elsewhere): its ClusterIP listeners drop every client;
- externalTrafficPolicy Local without a local endpoint: its external listeners drop every client
  but pods and the node itself, which kube-proxy short-circuits to every endpoint.
With externalTrafficPolicy Local, a connection to an external frontend from a pod or the node
itself (ClientOrigin, per connection) goes to `short_circuit_endpoints`, every other one to the
local endpoints (a third selector, "short"). Without any usable endpoint nothing listens: refused.

What it shares with the other ServicePorts comes through its constructor: the FlowAdmission
(flows are admitted there), the UdpRelay (its UDP listeners' flows), and the set of every
listening (address, port, protocol) of the relay, which it keeps up to date for its own listeners
and reads to refuse an endpoint that is one of them.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
from collections.abc import Collection
from typing import Union

from usproxy.flows.flow_table import Flow, HostPort
from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.local_detector import LocalDetector
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.relay.client_origin import ClientOrigin
from usproxy.relay.endpoint_selector import EndpointSelector
from usproxy.relay.flow_admission import FlowAdmission
from usproxy.relay.flow_owner import RelayStopping, SourceRefused
from usproxy.relay.port_capture import Frontend, PortCapture, port_held
from usproxy.relay.port_holder import describe_holder
from usproxy.relay.source_filter import DROP_ALL, Clause, allows, attach_clauses
from usproxy.relay.tcp import client_factory
from usproxy.relay.tcp_listener import TcpListener
from usproxy.relay.udp import UdpListener, UdpRelay
from usproxy.model.service_port import LBPolicy, ServicePort
from usproxy.model.source_ranges import allowed_sources
from usproxy.model.types import IPNetwork, Scope
from usproxy.model.types import ServicePortName, format_hostport

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
Listener = Union[TcpListener, UdpListener]
ListenerKey = tuple[str, int, Scope]  # (address, port, scope)
Listening = set[tuple[str, int, str]]  # (address, port, protocol) of every listener of the relay


class ServicePortRelay:
    """Listeners, selectors and flow bookkeeping of one ServicePort."""

    __slots__ = ("spn", "state", "admission", "udp", "listening", "default_policy", "selectors",
                 "short", "origin", "listeners", "errors", "failures", "firewall", "filtered", "stopping",
                 "capture", "captured", "refusing")

    def __init__(self, state: ServicePortState, *, admission: FlowAdmission, udp: UdpRelay,
                 listening: Listening, default_policy: LBPolicy, origin: ClientOrigin | None = None,
                 capture: PortCapture | None = None) -> None:
        """`default_policy` applies where the ServicePort names no load-balancing policy; `origin`
        tells pods and the node from outside clients (default: nothing is a pod or the node);
        `capture` takes the frontends whose port another socket holds (None: none is)."""
        self.spn: ServicePortName = state.service_port.name
        self.state = state
        self.admission = admission
        self.udp = udp
        self.listening = listening
        self.default_policy: LBPolicy = default_policy
        self.selectors: dict[Scope, EndpointSelector] = {
            "cluster": EndpointSelector(), "external": EndpointSelector()}
        self.short = EndpointSelector()  # externalTrafficPolicy Local: pods and the node, every endpoint
        self.origin = origin or ClientOrigin(LocalDetector(), lambda ip: False)
        self.listeners: dict[ListenerKey, Listener] = {}
        self.errors: dict[ListenerKey, str] = {}
        self.failures: dict[ListenerKey, str] = {}  # last logged bind failure, without its holder
        # loadBalancerSourceRanges: allowed sources by filtered LB IP (empty for most Services, so
        # `new_flow` costs them one falsy test), and the filter each listener socket carries
        self.firewall: dict[str, tuple[IPNetwork, ...]] = {}
        self.filtered: dict[ListenerKey, tuple[Clause, ...]] = {}
        self.stopping = False  # the relay stops: no new flow (`stop`)
        self.capture = capture
        self.captured: dict[ListenerKey, str] = {}  # listener -> how it is captured, for /services
        self.refusing: set[Frontend] = set()  # held frontends without a listener: refused

    # -- configuration -------------------------------------------------------------------------
    def desired(self, state: ServicePortState, node_ips: Collection[str]) -> set[ListenerKey]:
        """Listeners of every frontend whose kind has a usable endpoint, or drops where a Local
        policy leaves none here while the Service has some elsewhere (`clauses`)."""
        sp = state.service_port
        out: set[ListenerKey] = set()
        if state.cluster_endpoints or usable(state.endpoints):
            out |= {(str(ip), sp.port, "cluster") for ip in sp.cluster_ips}
        if state.external_endpoints or state.short_circuit_endpoints:
            out |= {(str(ip), sp.port, "external") for ip in sp.external_ips_all()}
            if sp.node_port:
                fams = {ip.version for ip in sp.cluster_ips}
                out |= {(ip, sp.node_port, "external") for ip in node_ips
                        if (6 if ":" in ip else 4) in fams}
        return out

    def frontends(self, state: ServicePortState, node_ips: Collection[str]) -> set[Frontend]:
        """Every (address, port, protocol) of the ServicePort, with endpoints or not."""
        sp, proto = state.service_port, self.spn.protocol
        out: set[Frontend] = {(str(ip), p, proto) for ip, p in sp.frontends()}
        if sp.node_port:
            fams = {ip.version for ip in sp.cluster_ips}
            out |= {(ip, sp.node_port, proto) for ip in node_ips if (6 if ":" in ip else 4) in fams}
        return out

    async def apply(self, state: ServicePortState, node_ips: Collection[str]) -> None:
        """Take a new state: update selectors, then open and close listeners as needed."""
        self.configure(state, node_ips)
        want = self.desired(state, node_ips)
        fronts = self.frontends(state, node_ips)
        for key in [k for k in self.listeners if k not in want]:
            await self._close_listener(key)
        await self._refuse_held({f for f in fronts if (f[0], f[1]) not in {(a, p) for a, p, _ in want}})
        if self.capture is not None:
            await self.capture.release(self.refusing - fronts)
            self.refusing &= fronts
        for key in [k for k in self.errors if k not in want and k not in self.listeners]:
            del self.errors[key]  # a frontend no longer wanted is not retried
            self.failures.pop(key, None)
        for key in sorted(want - self.listeners.keys()):
            await self._open_listener(key)
        for key in list(self.listeners):
            self._filter(key)

    def configure(self, state: ServicePortState, node_ips: Collection[str]) -> None:
        """Take a new state but its listeners: selectors, stale UDP flows, the firewall (the
        relay defers the listeners of a ServicePort the kernel serves from its first sync)."""
        self.state = state
        sp = state.service_port
        policy = sp.lb_policy or self.default_policy
        for kind, eps in self._endpoints(state).items():
            self.selectors[kind].update(eps, policy, sp.session_affinity, float(sp.affinity_timeout))
        self.short.update(state.short_circuit_endpoints, policy, sp.session_affinity, float(sp.affinity_timeout))
        self._close_stale_flows(state)
        self.firewall = firewall(sp, node_ips)

    def clauses(self, key: ListenerKey) -> tuple[Clause, ...]:
        """The socket filter of a listener (source_filter.py; none for most): every client dropped
        on a ClusterIP without a cluster endpoint; on an external frontend, the LB IP's
        loadBalancerSourceRanges, and with no local endpoint for externalTrafficPolicy Local
        only pods and the node (short-circuited) pass."""
        addr, _, kind = key
        if kind == "cluster":
            return () if self.state.cluster_endpoints else DROP_ALL
        sources = self.firewall.get(addr, ())
        out: tuple[Clause, ...] = (Clause(sources),) if sources else ()
        if not self.state.external_endpoints:
            out += (self.origin.clause(6 if ":" in addr else 4),)
        return out

    def refilter(self) -> None:
        """Filters again (the origin's interfaces changed)."""
        for key in list(self.listeners):
            self._filter(key)

    def _filter(self, key: ListenerKey) -> None:
        """Give the listener's socket its filter (`clauses`). A socket that refuses it is closed:
        its frontend is then failing (shown in /services, retried) rather than open to every
        source."""
        clauses = self.clauses(key)
        if self.filtered.get(key, ()) == clauses:
            return
        listener = self.listeners[key]
        try:
            attach_clauses(listener.sock, clauses)
        except (OSError, ValueError) as err:
            self.listeners.pop(key).close()
            self.listening.discard((key[0], key[1], self.spn.protocol))
            self.filtered.pop(key, None)
            self.errors[key] = f"socket filter on {format_hostport(key[0], key[1])}: {err}"
            log.error("%s: %s", self.spn, self.errors[key])
            return
        self.filtered[key] = clauses
        if isinstance(listener, UdpListener):
            listener.sources = self.firewall.get(key[0], ()) if key[2] == "external" else ()

    async def _listen(self, key: ListenerKey, bind_port: int | None = None) -> Listener:
        """A listener of frontend `key`, bound to its port or to `bind_port` (0: the kernel's pick)."""
        addr, port, kind = key
        if self.spn.protocol == "TCP":
            return await TcpListener.open(addr, port if bind_port is None else bind_port,
                                          client_factory(self, kind, (addr, port)))
        return UdpListener(self.udp, self, (addr, port), kind, bind_port)

    async def _captured_listener(self, key: ListenerKey) -> Listener:
        """A listener on a port of its own, with the frontend's traffic captured to it. Raises
        OSError when the capture is refused (the listener is closed again)."""
        assert self.capture is not None
        listener = await self._listen(key, 0)
        frontend = (key[0], key[1], self.spn.protocol)
        try:
            await self.capture.capture(frontend, listener.port)
        except BaseException:  # never a listener nobody knows of, the capture pointing at it
            listener.close()
            raise
        self.refusing.discard(frontend)
        return listener

    async def _open_listener(self, key: ListenerKey) -> None:
        addr, port, kind = key
        frontend = (addr, port, self.spn.protocol)
        try:
            if self.spn.protocol not in ("TCP", "UDP"):
                self.errors[key] = f"{self.spn.protocol} is not relayed in userspace"
                return
            self.admission.reserve_listener()  # listeners count against the flows' descriptor budget
            try:
                self.listeners[key] = await self._listen(key)
                if self.capture is not None and frontend in self.refusing:  # the holder has gone
                    self.refusing.discard(frontend)
                    await self.capture.release([frontend])
            except OSError as err:
                if err.errno != errno.EADDRINUSE or self.capture is None:
                    raise
                await self.capture.ready()
                if not self.capture.can(addr):
                    raise
                self.listeners[key] = await self._captured_listener(key)
                self.captured[key] = await self._capture_note(key)
        except OSError as err:
            await self._listen_failed(key, err)
            return
        if self.errors.pop(key, None) is not None:
            log.info("%s: listening on %s/%s after all", self.spn, format_hostport(addr, port), self.spn.protocol)
        self.failures.pop(key, None)
        self.listening.add((addr, port, self.spn.protocol))
        self._filter(key)
        log.debug("%s: listening on %s/%s", self.spn, format_hostport(addr, port), self.spn.protocol)

    async def _listen_failed(self, key: ListenerKey, err: OSError) -> None:
        """Record a failed bind for /services, logged once per change of cause, not once per retry
        (a held port is retried every sweep). A port in use names its holder (port_holder.py),
        looked up off the loop and only when the cause changes."""
        addr, port, _ = key
        cause = f"listen {format_hostport(addr, port)}: {err.strerror or err}"
        if self.failures.get(key) == cause:
            return
        self.failures[key] = self.errors[key] = cause
        if err.errno == errno.EADDRINUSE:
            holder = await asyncio.to_thread(describe_holder, addr, port, self.spn.protocol)
            if holder and self.errors.get(key) == cause:  # not opened nor dropped meanwhile
                self.errors[key] = f"{cause} ({holder}; its traffic goes there)"
        log.error("%s: %s", self.spn, self.errors.get(key, cause))

    async def _capture_note(self, key: ListenerKey) -> str:
        """How a captured frontend is served, for /services and the log (once per capture)."""
        assert self.capture is not None
        addr, port, _ = key
        holder = await asyncio.to_thread(describe_holder, addr, port, self.spn.protocol)
        note = (f"{holder}; " if holder else "") + f"captured by {self.capture.mode}"
        log.info("%s: %s/%s is held by another socket; %s", self.spn, format_hostport(addr, port),
                 self.spn.protocol, note)
        return note

    async def _refuse_held(self, frontends: set[Frontend]) -> None:
        """Frontends without a listener (no endpoints) whose port another socket holds are
        refused, not handed to the holder (kube-proxy rejects them). Checked with a throwaway
        bind when the ServicePort changes; one captured before stays refused."""
        if self.capture is None:
            return
        for f in sorted(frontends - self.refusing):
            if not port_held(*f):
                continue
            await self.capture.ready()
            if self.capture.can(f[0]):
                try:
                    await self.capture.refuse(f)
                    self.refusing.add(f)
                except OSError as err:
                    log.error("%s: refusing %s/%s: %s", self.spn, format_hostport(f[0], f[1]), f[2], err)

    async def _close_listener(self, key: ListenerKey, keep_capture: bool = False) -> None:
        # Established connections keep running (as kube-proxy); only accepting stops.
        self.listeners.pop(key).close()
        self.listening.discard((key[0], key[1], self.spn.protocol))
        self.errors.pop(key, None)
        self.filtered.pop(key, None)
        if self.captured.pop(key, None) is not None and self.capture is not None and not keep_capture:
            frontend = (key[0], key[1], self.spn.protocol)
            try:  # refused until it listens again or goes: never handed to the holder
                await self.capture.refuse(frontend)
                self.refusing.add(frontend)
            except OSError as err:
                log.error("%s: refusing %s/%s: %s", self.spn, format_hostport(key[0], key[1]), key[2], err)

    async def retry_failed(self) -> None:
        for key in list(self.errors):
            if key not in self.listeners:
                await self._open_listener(key)

    async def close(self, keep_capture: bool = False) -> None:
        """Close every listener. `keep_capture` (the agent's exit): the capture rules stay, and
        with the relay's ports closed they refuse until the next agent writes its own, so the
        holder never gets the frontends' traffic during a restart."""
        for key in list(self.listeners):
            await self._close_listener(key, keep_capture)
        if self.capture is not None and self.refusing and not keep_capture:
            await self.capture.release(self.refusing)
            self.refusing.clear()

    def _close_stale_flows(self, state: ServicePortState) -> None:
        """UDP flows whose endpoint left its kind's usable set (removed, not ready any more, port
        changed, policy changed) are closed in this sync, not at idle timeout: the client's next
        datagram picks again (C03). TCP connections run on, as in kube-proxy."""
        kept = self._endpoints(state)
        kept["external"] = (*kept["external"], *state.short_circuit_endpoints)  # short-circuited flows too
        for (_, _, kind), listener in self.listeners.items():
            if isinstance(listener, UdpListener):
                listener.keep_flows_to(kept[kind])

    @staticmethod
    def _endpoints(state: ServicePortState) -> dict[Scope, tuple[Endpoint, ...]]:
        return {"cluster": state.cluster_endpoints, "external": state.external_endpoints}

    # -- FlowOwner: used by the TCP and UDP relays -------------------------------------------------
    def pick(self, kind: Scope, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        """The endpoint for a new TCP connection or UDP flow, never one of this proxy's own
        listeners (an endpoint that is, say, its own NodePort would make every connection dial
        itself until descriptors run out): such an endpoint is logged and skipped. A pod or the
        node itself reaching an externalTrafficPolicy Local frontend is short-circuited to every
        endpoint (ClientOrigin), as kube-proxy."""
        selector = self.selectors[kind]
        if kind == "external" and self.state.short_circuit_endpoints and self.origin.internal(client_ip):
            selector = self.short
        own: set[Endpoint] = set()
        while True:
            ep = selector.pick(client_ip, {*exclude, *own} if own else exclude)
            if ep is None or not self._is_own_frontend(ep):
                return ep
            if ep in own:  # nothing but our own frontends is left
                return None
            limited.warning("%s: endpoint %s is this proxy's own frontend; refusing the loop", self.spn, ep)
            selector.failed(ep)
            own.add(ep)

    def _is_own_frontend(self, ep: Endpoint) -> bool:
        return (ep.host, ep.port, self.spn.protocol) in self.listening

    # An external flow may have been short-circuited: its endpoint's back-off and connection count
    # go to both selectors that may pick it (a count is the endpoint's load, whoever picked it).
    def failed(self, kind: Scope, ep: Endpoint) -> None:
        self.selectors[kind].failed(ep)
        if kind == "external" and self.short.endpoints:
            self.short.failed(ep)

    def opened(self, kind: Scope, ep: Endpoint) -> None:
        self.selectors[kind].opened(ep)
        if kind == "external" and self.short.endpoints:
            self.short.opened(ep)

    def closed(self, kind: Scope, ep: Endpoint) -> None:
        self.selectors[kind].closed(ep)
        if kind == "external" and self.short.endpoints:
            self.short.closed(ep)

    def stop(self) -> None:
        """The relay stops (Relay.close): every flow from now on is refused (`new_flow`)."""
        self.stopping = True

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        """Admit a flow (FlowAdmission: may evict an idle UDP flow; raises FlowTableFull), unless
        the client is outside the LB IP's loadBalancerSourceRanges (raises SourceRefused) or the
        relay stops (raises RelayStopping)."""
        if self.stopping:
            raise RelayStopping(f"{self.spn}: the relay stops")
        if self.firewall and not allows(self.firewall.get(frontend[0], ()), client[0]):
            raise SourceRefused(f"{client[0]} is outside loadBalancerSourceRanges of {frontend[0]}")
        return self.admission.admit(protocol, self.spn, client, frontend)

    def end_flow(self, flow: Flow) -> None:
        self.admission.release(flow)

    def reserve_pipes(self) -> bool:
        return self.admission.reserve_pipes()

    def release_pipes(self) -> None:
        self.admission.release_pipes()


_NO_FIREWALL: dict[str, tuple[IPNetwork, ...]] = {}  # shared, never changed: most ServicePorts have none


def firewall(sp: ServicePort, node_ips: Collection[str]) -> dict[str, tuple[IPNetwork, ...]]:
    """Allowed sources by LoadBalancer IP (text) of the IPs that are filtered, as nftables
    (usproxy.model.source_ranges.allowed_sources; `node_ips` stand for kube-proxy's node IP)."""
    if not sp.source_ranges or not sp.load_balancer_ips:
        return _NO_FIREWALL
    nodes = [ipaddress.ip_address(ip) for ip in node_ips]
    out = {}
    for ip in sp.load_balancer_ips:
        same = [x for x in sp.load_balancer_ips if x.version == ip.version]
        sources = allowed_sources(sp.source_ranges, ip.version, same, nodes)
        if sources:
            out[str(ip)] = sources
    return out
