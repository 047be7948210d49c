"""The UDP relay: listeners on frontend addresses and one connected socket per client flow.

A flow is (frontend address, client address) → one endpoint, created atomically inside the
datagram callback (two datagrams from a new client arriving back to back make one flow). Both the
listener and the flow sockets are read with `add_reader` into one shared buffer (UdpBatch), always
with 64 KiB free, so a datagram of any size up to 65,507 bytes (65,527 over IPv6) keeps its
boundaries and is never truncated (C05); datagrams read back to back for one flow leave in one
UDP_SEGMENT send, which the kernel cuts into the same datagrams (udp_batch.py).
Replies leave through the listener socket, which is bound to exactly the address the client sent
to, so the reply's source is that address and port (C06). Flows are kept in last-activity order,
all of them and each client address's own (`by_client`): idle ones (either direction counts)
expire after `idle_timeout`, `evict_oldest` closes the longest-idle one when FlowAdmission needs
room (C08), or when a socket cannot be opened for lack of descriptors (the budget was wrong:
recover rather than drop the flow), and `evict_oldest_of` closes a client's own longest-idle one
when that client holds its fair share (FlowAdmission, issue 29 item 9). ICMP errors from an
endpoint surface as ECONNREFUSED on its flow: logged at a bounded rate, never fatal, and the flow's
socket is watched anew (on uvloop an error event stops the watch), so the error is transient.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from usproxy.flows.flow_table import Flow, FlowTableFull, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.relay.flow_owner import FlowOwner, SourceRefused
from usproxy.relay.source_filter import allows
from usproxy.relay.tcp_listener import freebind
from usproxy.relay.udp_batch import MAX_DATAGRAM, MIN_SEGMENT, UdpBatch, refused, send_segments
from usproxy.model.types import IPNetwork, Scope
from usproxy.model.types import format_hostport

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

FlowKey = tuple[HostPort, HostPort]  # (frontend, client)


def rewatch(sock: socket.socket, callback: Callable[..., None], *args: object) -> None:
    """Register `sock` for reading again after it reported an error. libuv (uvloop) stops polling
    an fd once epoll says EPOLLERR, which an ICMP error on a connected UDP socket raises, so
    without this one port unreachable would silence a flow for good. Errors only: never per
    datagram."""
    loop = asyncio.get_running_loop()
    loop.remove_reader(sock.fileno())
    loop.add_reader(sock.fileno(), callback, *args)


class UdpFlow:
    """One client association: a socket connected to the chosen endpoint."""

    __slots__ = ("key", "listener", "endpoint", "sock", "flow", "peers")

    def __init__(self, key: FlowKey, listener: UdpListener, endpoint: Endpoint, sock: socket.socket,
                 flow: Flow, peers: OrderedDict[FlowKey, UdpFlow]) -> None:
        self.key = key
        self.listener = listener
        self.endpoint = endpoint
        self.sock = sock
        self.flow = flow
        self.peers = peers  # the flows of the same client address, in last-activity order


class UdpRelay:
    """Every UDP listener and flow of the agent, with one shared receive buffer."""

    def __init__(self, idle_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self.flows: OrderedDict[FlowKey, UdpFlow] = OrderedDict()
        self.by_client: dict[str, OrderedDict[FlowKey, UdpFlow]] = {}  # client address -> its flows
        self.batch = UdpBatch()  # the receive buffer of every callback, and what they send next

    # -- flows ---------------------------------------------------------------------------------
    def flow_for(self, listener: UdpListener, client: HostPort) -> UdpFlow | None:
        key = (listener.frontend, client)
        uf = self.flows.get(key)
        if uf is not None:
            self.flows.move_to_end(key)
            uf.peers.move_to_end(key)
            return uf
        return self._open(listener, key)

    def _open(self, listener: UdpListener, key: FlowKey) -> UdpFlow | None:
        owner = listener.owner
        if listener.sources and not allows(listener.sources, key[1][0]):
            return None  # loadBalancerSourceRanges (before the socket filter was in place): dropped
        ep = owner.pick(listener.kind, key[1][0], ())
        if ep is None:
            return None
        try:
            flow = owner.new_flow("UDP", key[1], key[0])  # may evict the longest-idle flow
        except FlowTableFull:
            limited.warning("flow table full: dropping UDP for %s", owner.spn)
            return None
        except SourceRefused:  # outside loadBalancerSourceRanges: dropped, no flow
            return None
        sock = self._socket(ep)
        if sock is None:
            owner.end_flow(flow)
            return None
        flow.endpoint, flow.state = (ep.host, ep.port), "UNREPLIED"
        local = sock.getsockname()
        flow.local = (local[0], local[1])
        peers = self.by_client.get(key[1][0])
        if peers is None:
            peers = self.by_client[key[1][0]] = OrderedDict()
        uf = UdpFlow(key, listener, ep, sock, flow, peers)
        self.flows[key] = listener.flows[key] = peers[key] = uf
        owner.opened(listener.kind, ep)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._reply, uf)
        return uf

    def _socket(self, ep: Endpoint) -> socket.socket | None:
        for _ in range(2):
            try:
                sock = socket.socket(socket.AF_INET6 if ep.ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM)
            except OSError as err:
                limited.warning("cannot open a UDP socket: %s", err)  # EMFILE: the fd budget is off
                if err.errno not in (errno.EMFILE, errno.ENFILE) or not self.flows:
                    return None
                self.evict_oldest()  # free a descriptor and try once more
                continue
            sock.setblocking(False)
            try:
                sock.connect((ep.host, ep.port))
            except OSError as err:
                sock.close()
                limited.warning("cannot connect UDP to %s: %s", ep, err)
                return None
            return sock
        return None

    def close_flow(self, uf: UdpFlow) -> None:
        if self.flows.pop(uf.key, None) is None:
            return
        del uf.listener.flows[uf.key]
        del uf.peers[uf.key]
        if not uf.peers:
            del self.by_client[uf.key[1][0]]
        try:
            asyncio.get_running_loop().remove_reader(uf.sock.fileno())
        except RuntimeError:
            pass
        uf.sock.close()
        uf.listener.owner.closed(uf.listener.kind, uf.endpoint)
        uf.listener.owner.end_flow(uf.flow)

    def evict_oldest(self) -> bool:
        """Close the longest-idle flow; False when there is none."""
        if not self.flows:
            return False
        self.close_flow(next(iter(self.flows.values())))
        return True

    def evict_oldest_of(self, client_ip: str) -> bool:
        """Close the longest-idle flow of client address `client_ip`; False when it has none."""
        peers = self.by_client.get(client_ip)
        if not peers:
            return False
        self.close_flow(next(iter(peers.values())))
        return True

    def expire(self, now: float | None = None) -> int:
        """Close flows idle longer than the timeout; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self.flows:
            uf = next(iter(self.flows.values()))
            if now - uf.flow.last_seen < self.idle_timeout:
                break
            self.close_flow(uf)
            n += 1
        return n

    def rewatch(self, uf: UdpFlow) -> None:
        rewatch(uf.sock, self._reply, uf)

    # -- datagrams -----------------------------------------------------------------------------
    def _reply(self, uf: UdpFlow) -> None:
        """Endpoint → client: read every queued reply, send them from the listener's address
        (equal-size ones batched, udp_batch.py)."""
        batch = self.batch
        try:
            for _ in range(64):
                try:
                    n = uf.sock.recv_into(batch.free, MAX_DATAGRAM)
                except BlockingIOError:
                    return
                except OSError as err:  # ECONNREFUSED from ICMP port unreachable: transient
                    limited.warning("%s: endpoint %s: %s", uf.listener.owner.spn, uf.endpoint, err)
                    self.rewatch(uf)
                    return
                uf.flow.seen_out(n)
                uf.flow.state = "ASSURED"
                self.flows.move_to_end(uf.key)
                uf.peers.move_to_end(uf.key)
                if n < MIN_SEGMENT and not batch.count:  # small, nothing pending: at once
                    uf.listener.send(uf.key[1], batch.free[:n])
                    continue
                batch.add(uf.key, n, uf.listener.send, uf.key[1])
        finally:
            batch.flush()


class UdpListener:
    """A UDP socket bound to one frontend (ClusterIP:port, external IP:port or node IP:NodePort),
    or, for a frontend whose port another socket holds, to a port of its own on the same address
    (`port` 0: the kernel's pick), where the capture sends the frontend's datagrams and whose
    replies conntrack gives the frontend's port back (port_capture.py). Flows are keyed by the
    frontend either way."""

    __slots__ = ("relay", "owner", "frontend", "kind", "flows", "sources", "sock", "port")

    def __init__(self, relay: UdpRelay, owner: FlowOwner, frontend: HostPort, kind: Scope,
                 port: int | None = None) -> None:
        self.relay = relay
        self.owner = owner
        self.frontend = frontend
        self.kind = kind
        self.flows: dict[FlowKey, UdpFlow] = {}  # this listener's share of relay.flows
        self.sources: tuple[IPNetwork, ...] = ()  # loadBalancerSourceRanges of an LB IP (empty: all)
        family = socket.AF_INET6 if ":" in frontend[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.setblocking(False)
            freebind(self.sock)  # bound before the address is on the ClusterIP interface
            self.sock.bind((frontend[0], frontend[1] if port is None else port))
            self.port = int(self.sock.getsockname()[1])
        except OSError:
            self.sock.close()
            raise
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._receive)

    def _receive(self) -> None:
        relay, batch = self.relay, self.relay.batch
        try:
            for _ in range(64):
                try:
                    n, client = self.sock.recvfrom_into(batch.free, MAX_DATAGRAM)
                except BlockingIOError:
                    return
                except OSError as err:
                    limited.warning("%s: listener %s: %s", self.owner.spn, format_hostport(*self.frontend), err)
                    rewatch(self.sock, self._receive)
                    return
                key = (self.frontend, (client[0], client[1]))
                if batch.count and batch.key != key:
                    batch.cut()  # before flow_for, which may evict (close) the pending flow
                uf = relay.flow_for(self, key[1])
                if uf is None:
                    continue
                uf.flow.seen_in(n)
                if n < MIN_SEGMENT and not batch.count:  # small, nothing pending: at once
                    self._forward(uf, batch.free[:n], 0)
                    continue
                batch.add(key, n, self._forward, uf)
        finally:
            batch.flush()

    def _forward(self, uf: UdpFlow, data: memoryview, segment: int) -> None:
        """Client → endpoint: one datagram (`segment` 0) or a batch of `segment`-byte ones."""
        for _ in range(2):  # a pending ICMP error is reported by (and fails) one send: retry once
            try:
                if segment:
                    send_segments(uf.sock, data, segment)
                else:
                    uf.sock.send(data)
                return
            except BlockingIOError:
                limited.warning("%s: send buffer full, datagram dropped", self.owner.spn)
                return
            except OSError as err:
                if segment and refused(err):  # this path cannot segment: datagram by datagram
                    for one in UdpBatch.singly(data, segment):
                        self._forward(uf, one, 0)
                    return
                # the error event may have stopped the reader: watch anew
                limited.warning("%s: endpoint %s: %s", self.owner.spn, uf.endpoint, err)
                self.relay.rewatch(uf)

    def send(self, client: HostPort, data: memoryview, segment: int = 0) -> None:
        """A reply (`segment` 0) or a batch of `segment`-byte replies to `client`."""
        try:
            if segment:
                send_segments(self.sock, data, segment, client)
            else:
                self.sock.sendto(data, client)
        except OSError as err:
            if segment and refused(err):
                for one in UdpBatch.singly(data, segment):
                    self.send(client, one)
                return
            limited.warning("%s: reply to %s dropped: %s", self.owner.spn, format_hostport(*client), err)

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except RuntimeError:
            pass
        for uf in list(self.flows.values()):
            self.relay.close_flow(uf)
        self.sock.close()

    def keep_flows_to(self, usable: Collection[Endpoint]) -> int:
        """Close every flow whose endpoint is not in `usable` (compared by address and port), so
        its next datagram picks again; returns how many. Endpoints that stay usable keep their
        flows even when their conditions change."""
        keep = {ep.address for ep in usable}
        stale = [uf for uf in self.flows.values() if uf.endpoint.address not in keep]
        for uf in stale:
            self.relay.close_flow(uf)
        return len(stale)
