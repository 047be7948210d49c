"""Service health server: kube-proxy's per-Service health check on spec.healthCheckNodePort.

As kube-proxy pkg/proxy/healthcheck/service_health.go: one HTTP listener per Service that has a
healthCheckNodePort (a LoadBalancer with externalTrafficPolicy Local), on the NodePort addresses
(--nodeport-addresses; none given: every address, one dual-stack wildcard socket). Every path
answers 200 when the Service has at least one local ready endpoint and the proxy is healthy
(/healthz's sync rule), else 503, with kube-proxy's headers and JSON body. Load balancers probe it
to decide which nodes get traffic, so:

- a request never waits for a sync: the handler reads `counts` (a dict the sync replaces, whole,
  after the datapaths applied it) and the proxy's health, and awaits nothing;
- listeners follow SyncServices semantics: opened for new Services, closed for removed ones or a
  changed port, kept otherwise; a port that cannot be bound is logged with its errno, shown in
  `errors` (and /services), leaves the other Services alone, and is retried at the next sync
  (at least every sync period);
- bounded as the admin servers (usproxy.admin.server): all health check listeners together hold
  at most `connection_limit(RLIMIT_NOFILE)` (64) connections and one Service at most a quarter
  of them, so a flood on one port cannot starve the probes of the others nor take the relay's
  descriptor reserve; a connection without a complete request head IDLE_TIMEOUT seconds after
  it opened or its last answer is closed. A bound never starves a probe: over it, the connection
  idle the longest (of that Service when its share is full) is closed to make room, as the admin
  servers do (`longest_idle`); only when each has a request in flight is the new one reset.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from usproxy.admin.send_watch import SendWatch
from usproxy.admin.server import IDLE_TIMEOUT, MAX_HEAD_LINE, Refused, connection_limit, longest_idle
from usproxy.model.node import NodeFacts
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.model.types import IPAddress, NamespacedName, format_hostport

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
BACKLOG = 128
SERVICE_SHARE = 4  # one Service holds at most 1/4 of the connections of all health checks


@dataclass(frozen=True, slots=True)
class HealthReply:
    """One answer of a Service health check: HTTP status, headers and body (text)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: str


def reply(name: NamespacedName, local_endpoints: int, proxy_healthy: bool) -> HealthReply:
    """kube-proxy's hcHandler answer: 200 when `local_endpoints` > 0 and the proxy is healthy,
    else 503; Content-Type application/json, X-Content-Type-Options nosniff and
    X-Load-Balancing-Endpoint-Weight (the count); the body is kube-proxy's tab-indented JSON
    without a trailing newline."""
    status = 200 if local_endpoints and proxy_healthy else 503
    body = "\n".join((
        "{",
        '\t"service": {',
        f'\t\t"namespace": {json.dumps(name.namespace)},',
        f'\t\t"name": {json.dumps(name.name)}',
        "\t},",
        f'\t"localEndpoints": {local_endpoints},',
        f'\t"serviceProxyHealthy": {"true" if proxy_healthy else "false"}',
        "}",
    ))
    headers = (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"),
               ("X-Load-Balancing-Endpoint-Weight", str(local_endpoints)))
    return HealthReply(status, headers, body)


@dataclass(slots=True)
class _Check:
    """One Service's health check: its port, the aiohttp server its listeners share, the
    listeners, and why it does not listen (None while it does)."""

    port: int
    server: web.Server
    listeners: list[asyncio.AbstractServer] = field(default_factory=list)
    error: str | None = None


class ServiceHealthServer:
    """kube-proxy's ServiceHealthServer. `sync(ports, counts)` after each successful sync;
    `proxy_healthy()` is /healthz's sync health (not node eligibility), read per request."""

    def __init__(self, node: NodeFacts, proxy_healthy: Callable[[], bool], *,
                 exclude_interface: str | None = None, max_connections: int | None = None) -> None:
        """`exclude_interface`: an interface whose addresses never serve (the relay's ClusterIP
        interface). `max_connections` for all checks together; None: `connection_limit` of the
        soft RLIMIT_NOFILE when the first check opens."""
        self.node = node
        self.proxy_healthy = proxy_healthy
        self.exclude_interface = exclude_interface
        self.max_connections = max_connections
        self.checks: dict[NamespacedName, _Check] = {}
        self.counts: dict[NamespacedName, int] = {}
        self.send_watch = SendWatch(self._connections, "health checks")

    # -- sync ---------------------------------------------------------------------------------
    async def sync(self, ports: Mapping[NamespacedName, int], counts: Mapping[NamespacedName, int]) -> None:
        """SyncServices then SyncEndpoints: `ports` the healthCheckNodePort of each Service that
        has one, `counts` the local ready endpoints per Service (others are ignored, a missing
        one is 0). Never raises for a port it cannot bind (see `errors`)."""
        self.counts = {name: counts.get(name, 0) for name in ports}
        if ports and not self.send_watch.running:
            self.send_watch.start()
        for name, check in list(self.checks.items()):
            if ports.get(name) != check.port:
                del self.checks[name]
                log.info("closing health check of %s on port %d", name, check.port)
                await _close(check)
        for name, port in ports.items():
            check = self.checks.get(name) or self.checks.setdefault(name, _Check(port, self._web_server(name)))
            if check.error is not None or not check.listeners:
                await self._open(name, check)

    def errors(self) -> dict[NamespacedName, str]:
        """Why a Service's health check does not listen, per Service."""
        return {name: c.error for name, c in self.checks.items() if c.error is not None}

    def error_of(self, name: NamespacedName) -> str | None:
        """Why the health check of `name` does not listen (None: it does, or it has none)."""
        check = self.checks.get(name)
        return check.error if check is not None else None

    def listening(self, name: NamespacedName) -> list[tuple[str, int]]:
        """The (address, port) pairs the health check of `name` listens on."""
        check = self.checks.get(name)
        out: list[tuple[str, int]] = []
        for listener in check.listeners if check is not None else ():
            for sock in getattr(listener, "sockets", None) or ():
                addr = sock.getsockname()
                out.append((str(addr[0]), int(addr[1])))
        return out

    async def close(self) -> None:
        await self.send_watch.stop()
        for check in self.checks.values():
            await _close(check)
        self.checks.clear()

    def _connections(self) -> list[web.RequestHandler]:
        return [h for c in self.checks.values() for h in c.server.connections]

    # -- serving ------------------------------------------------------------------------------
    def _web_server(self, name: NamespacedName) -> web.Server:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            # no await before answering: a sync in progress never delays a probe
            r = reply(name, self.counts.get(name, 0), self.proxy_healthy())
            return web.Response(status=r.status, text=r.body, headers=dict(r.headers))
        return web.Server(handle, access_log=None, keepalive_timeout=IDLE_TIMEOUT,
                          max_line_size=MAX_HEAD_LINE, max_field_size=MAX_HEAD_LINE)

    def _limits(self) -> tuple[int, int]:
        if self.max_connections is None:
            self.max_connections = connection_limit(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        total = self.max_connections
        return total, max(1, total // SERVICE_SHARE)

    def _factory(self, name: NamespacedName, server: web.Server) -> Callable[[], asyncio.Protocol]:
        total, per_service = self._limits()

        def factory() -> asyncio.Protocol:
            mine = _live(server)
            every = [h for c in self.checks.values() for h in _live(c.server)]
            if len(mine) >= per_service or len(every) >= total:
                victim = longest_idle(mine if len(mine) >= per_service else every)
                if victim is None:
                    limited.warning("health check of %s: connection limit reached, each with a request in "
                                    "flight; refusing more", name)
                    return Refused()
                limited.warning("health check of %s: connection limit reached; closing the one idle the longest",
                                name)
                victim.force_close()
            return server()
        return factory

    async def _open(self, name: NamespacedName, check: _Check) -> None:
        """Listen on every NodePort address, or on none (closing what opened) and record why."""
        await _close_listeners(check)
        loop = asyncio.get_running_loop()
        try:
            for host in await self._addresses():
                sock = _bound_socket(host, check.port)
                try:
                    check.listeners.append(await loop.create_server(self._factory(name, check.server), sock=sock))
                except BaseException:
                    sock.close()
                    raise
        except OSError as err:
            await _close_listeners(check)
            error = f"cannot listen on port {check.port}: {err}"
            # logged when it starts or changes: a retry every sync must not flood the log
            (log.debug if error == check.error else log.error)(
                "health check of %s: %s; retried at the next sync", name, error)
            check.error = error
            return
        check.error = None
        log.info("health check of %s listening on %s", name,
                 ", ".join(format_hostport(h, p) for h, p in self.listening(name)))

    async def _addresses(self) -> list[str]:
        """"::" (dual-stack, or "0.0.0.0" without IPv6) when --nodeport-addresses is not given,
        as kube-proxy's nodePortAddresses.MatchAll(); else this node's addresses inside those
        CIDRs, read now (they may have changed since the last try). Raises OSError when none
        matches."""
        if not self.node.nodeport_cidrs:
            return ["::" if socket.has_ipv6 else "0.0.0.0"]
        nets = self.node.nodeport_cidrs
        try:
            local = await asyncio.to_thread(_local_addresses, self.exclude_interface)
        except Exception as err:  # a netlink error (pyroute2's NetlinkError is no OSError)
            raise OSError(f"cannot list this node's addresses: {err}") from err
        matched = sorted({str(ip) for ip in local if any(ip in n for n in nets)})
        if not matched:
            raise OSError(f"no address of this node is in --nodeport-addresses "
                          f"{','.join(str(n) for n in nets)}")
        return matched


def _bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; "::" accepts IPv4 too (IPV6_V6ONLY off), falling
    back to 0.0.0.0 where the kernel has no IPv6. Raises OSError (with its errno)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        if host != "::":
            raise
        host, sock = "0.0.0.0", socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"{format_hostport(host, port)}: {err.strerror}") from None
    return sock


def _local_addresses(exclude: str | None) -> list[IPAddress]:
    """Every address on this host but link-local ones and those of `exclude` (pyroute2, so run
    it in a thread)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = []
        for a in ipr.get_addr():
            ip = ipaddress.ip_address(a.get_attr("IFA_ADDRESS"))
            if names.get(a["index"]) != exclude and not ip.is_link_local:
                out.append(ip)
        return out


def _live(server: web.Server) -> list[web.RequestHandler]:
    """`server`'s connections that are not closing."""
    return [h for h in server.connections if h.transport is not None]


async def _close_listeners(check: _Check) -> None:
    for listener in check.listeners:
        listener.close()
    check.listeners.clear()


async def _close(check: _Check) -> None:
    """Stop listening and end the check's connections (as http.Server.Close)."""
    await _close_listeners(check)
    await check.server.shutdown(0.1)
