"""ServicePortRelay: the relay's runtime state for one ServicePort.

It owns the listeners of that ServicePort (ClusterIPs and external IPs on `port`, node addresses
on the NodePort; TCP or UDP by the ServicePort's protocol), one EndpointSelector per traffic kind
("cluster" for ClusterIPs, "external" for NodePorts, externalIPs and LoadBalancer IPs, which obey
externalTrafficPolicy), and counts of its flows. A frontend listens only while its kind has a
usable endpoint, so the kernel refuses at once otherwise (C01, C03). `apply()` diffs listeners by
(address, port, protocol) and touches nothing that did not change (C21); after it, no UDP flow
points at an endpoint outside its kind's usable set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Union

from usproxy.conntrack.flow_table import Flow, HostPort
from usproxy.datapath import ServicePortState
from usproxy.endpoint import Endpoint
from usproxy.ratelimit import RateLimitedLog
from usproxy.relay.endpoint_selector import EndpointSelector
from usproxy.relay.tcp import ClientSide, keepalive_listeners, serve_kwargs
from usproxy.relay.udp import UdpListener
from usproxy.types import ServicePortName, format_hostport

if TYPE_CHECKING:
    from usproxy.relay.relay import Relay

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
Listener = Union[asyncio.AbstractServer, UdpListener]
ListenerKey = tuple[str, int, str]  # (address, port, kind)


class ServicePortRelay:
    """Listeners, selectors and flow bookkeeping of one ServicePort."""

    def __init__(self, relay: Relay, state: ServicePortState) -> None:
        self.relay = relay
        self.spn: ServicePortName = state.service_port.name
        self.state = state
        self.selectors = {"cluster": EndpointSelector(), "external": EndpointSelector()}
        self.listeners: dict[ListenerKey, Listener] = {}
        self.errors: dict[ListenerKey, str] = {}
        self.flows = 0

    # -- configuration -------------------------------------------------------------------------
    def desired(self, state: ServicePortState, node_ips: Collection[str]) -> set[ListenerKey]:
        sp = state.service_port
        out: set[ListenerKey] = set()
        if state.cluster_endpoints:
            out |= {(str(ip), sp.port, "cluster") for ip in sp.cluster_ips}
        if state.external_endpoints:
            out |= {(str(ip), sp.port, "external") for ip in sp.external_ips_all()}
            if sp.node_port:
                fams = {ip.version for ip in sp.cluster_ips}
                out |= {(ip, sp.node_port, "external") for ip in node_ips
                        if (6 if ":" in ip else 4) in fams}
        return out

    async def apply(self, state: ServicePortState, node_ips: Collection[str]) -> None:
        """Take a new state: update selectors, then open and close listeners as needed."""
        self.state = state
        sp = state.service_port
        policy = sp.lb_policy or self.relay.default_policy
        for kind, eps in (("cluster", state.cluster_endpoints), ("external", state.external_endpoints)):
            self.selectors[kind].update(eps, policy, sp.session_affinity, float(sp.affinity_timeout))
        self._close_stale_flows(state)
        want = self.desired(state, node_ips)
        for key in [k for k in self.listeners if k not in want]:
            await self._close_listener(key)
        for key in sorted(want - self.listeners.keys()):
            await self._open_listener(key)

    async def _open_listener(self, key: ListenerKey) -> None:
        addr, port, kind = key
        try:
            if self.spn.protocol == "TCP":
                loop = asyncio.get_running_loop()
                server = await loop.create_server(
                    lambda: ClientSide(self, kind, (addr, port)), addr, port, **serve_kwargs())
                keepalive_listeners(server)
                self.listeners[key] = server
            elif self.spn.protocol == "UDP":
                self.listeners[key] = UdpListener(self.relay.udp, self, (addr, port), kind)
            else:
                self.errors[key] = f"{self.spn.protocol} is not relayed in userspace"
                return
        except OSError as err:
            self.errors[key] = f"listen {format_hostport(addr, port)}: {err.strerror or err}"
            log.error("%s: %s", self.spn, self.errors[key])
            return
        self.errors.pop(key, None)
        self.relay.listening.add((addr, port, self.spn.protocol))
        log.debug("%s: listening on %s/%s", self.spn, format_hostport(addr, port), self.spn.protocol)

    async def _close_listener(self, key: ListenerKey) -> None:
        listener = self.listeners.pop(key)
        listener.close()  # only accepting stops: established connections keep running (as kube-proxy)
        self.relay.listening.discard((key[0], key[1], self.spn.protocol))
        self.errors.pop(key, None)

    async def retry_failed(self) -> None:
        for key in list(self.errors):
            if key not in self.listeners:
                await self._open_listener(key)

    async def close(self) -> None:
        for key in list(self.listeners):
            await self._close_listener(key)

    def _close_stale_flows(self, state: ServicePortState) -> None:
        """UDP flows whose endpoint left its kind's usable set (removed, not ready any more, port
        changed, policy changed) are closed in this sync, not at idle timeout: the client's next
        datagram picks again (C03). TCP connections run on, as in kube-proxy."""
        usable = {"cluster": state.cluster_endpoints, "external": state.external_endpoints}
        for (_, _, kind), listener in self.listeners.items():
            if isinstance(listener, UdpListener):
                listener.keep_flows_to(usable[kind])

    # -- used by the TCP and UDP relays ----------------------------------------------------------
    def pick(self, kind: str, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        """The endpoint for a new TCP connection or UDP flow, never one of this proxy's own
        listeners (an endpoint that is, say, its own NodePort would make every connection dial
        itself until descriptors run out): such an endpoint is logged and skipped."""
        selector = self.selectors[kind]
        own: set[Endpoint] = set()
        while True:
            ep = selector.pick(client_ip, {*exclude, *own} if own else exclude)
            if ep is None or not self._is_own_frontend(ep):
                return ep
            if ep in own:  # nothing but our own frontends is left
                return None
            limited.warning("%s: endpoint %s is this proxy's own frontend; refusing the loop", self.spn, ep)
            selector.failed(ep, client_ip)
            own.add(ep)

    def _is_own_frontend(self, ep: Endpoint) -> bool:
        return (str(ep.ip), ep.port, self.spn.protocol) in self.relay.listening

    def failed(self, kind: str, ep: Endpoint, client_ip: str) -> None:
        self.selectors[kind].failed(ep, client_ip)

    def opened(self, kind: str, ep: Endpoint) -> None:
        self.selectors[kind].opened(ep)

    def closed(self, kind: str, ep: Endpoint) -> None:
        self.selectors[kind].closed(ep)

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        """Add a flow; when the table is full the longest-idle UDP flow makes room (a UDP flood
        of fresh source ports must not lock TCP out). Raises FlowTableFull otherwise."""
        table = self.relay.flow_table
        if len(table) >= table.max_flows and self.relay.udp.flows:
            self.relay.udp.evict_oldest()
        flow = table.add(Flow(protocol, self.spn, client, frontend))
        self.flows += 1
        return flow

    def end_flow(self, flow: Flow) -> None:
        self.relay.flow_table.remove(flow)
        self.flows -= 1
