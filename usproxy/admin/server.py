"""The admin HTTP servers (aiohttp).

healthz address (default 0.0.0.0:10256): /healthz and /livez, kube-proxy's JSON body, 200 or 503.
metrics address (default 127.0.0.1:10249): /metrics (Prometheus text), /services and /flows (JSON),
and the live page /view (web_view.py).
When both addresses are equal one server serves every path.

/services and /flows never stall the relay: their rows are built on the loop in chunks with the
loop running between them, encoded in a worker thread, and built once for every client that asks
while a build runs (usproxy.admin.snapshot).

Bounded, so that no client can take the node's descriptors (issue 18: idle connections to the
health port exhausted them, and the manifest directory then read as empty): each listener holds
at most MAX_CONNECTIONS connections, fewer under a low descriptor limit (`connection_limit`), one
client address at most half of them (`client_share`), and a connection that has not sent
a complete request head IDLE_TIMEOUT seconds after it opened or after its last response is closed
(aiohttp's keep-alive timer, which also runs before the first request). Both listeners together stay
within the relay's descriptor reserve (FlowAdmission.FD_RESERVE).

A bound never starves a probe: a new connection over the listener's limit, or over its address's
share, is served by closing the connection idle the longest (of that address when its share is
full; of all otherwise), as nginx reuses idle keep-alive connections when out of
worker_connections (ngx_drain_connections). Idle means no request in flight: between requests or
before the first, a partial request head included (aiohttp's own idle rule). A connection with a
request in flight is never closed; only when every connection that could make room has one is
the new one reset at once. So idle connections from the load balancer's own address (a health
checker behind the same NAT, or 127.0.0.1) cannot keep its probe out until the idle timeout.
A request in flight whose answer waits SEND_TIMEOUT for a client that does not read is given up
(send_watch.py), so neither can a client that asks and never reads.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from usproxy.admin import web_view
from usproxy.admin.health import Health
from usproxy.admin.send_watch import SendWatch, reset
from usproxy.admin.snapshot import SharedBuild, encoded_rows, write_chunked
from usproxy.model.types import format_hostport
from usproxy.util import host_port
from usproxy.util.errors import CannotRun
from usproxy.util.metrics import Metrics
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.util.rows import FlowRow, ServiceRow

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
MAX_CONNECTIONS = 64  # per listener; two listeners take at most a half of FD_RESERVE
FD_SHARE = 16  # and at most 1/16 of the descriptor limit each (FD_RESERVE is at least 1/4 of it)
IDLE_TIMEOUT = 10.0  # seconds a connection may stay without a complete request head
MAX_HEAD_LINE = 8190  # bytes of the request line and of each header (aiohttp's default, stated)


class AdminView(Protocol):
    """What the admin server reads from the agent."""

    metrics: Metrics

    def health(self) -> Health: ...

    async def services(self) -> list[ServiceRow]: ...

    async def flows(self) -> list[FlowRow]: ...


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body, indent=1) + "\n", status=status, content_type="application/json")


async def _send_json(request: web.Request, body: list[bytes]) -> web.StreamResponse:
    """Answer with `body` (JSON text in parts) a chunk at a time (snapshot.write_chunked)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    resp.content_length = sum(len(part) for part in body)
    await resp.prepare(request)
    await write_chunked(resp, body)
    await resp.write_eof()
    return resp


def _health_handler(view: AdminView, require_eligible: bool) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.Response:
        h = view.health()
        ok = h.healthy and (h.node_eligible or not require_eligible)
        return _json(h.body(), 200 if ok else 503)
    return handle


def health_routes(app: web.Application, view: AdminView) -> None:
    """/healthz also fails while this node is being deleted (kube-proxy's nodeEligible);
    /livez only reflects the proxy's own sync health."""
    app.router.add_get("/healthz", _health_handler(view, require_eligible=True))
    app.router.add_get("/livez", _health_handler(view, require_eligible=False))


def metrics_routes(app: web.Application, view: AdminView) -> None:
    metrics_build = SharedBuild(view.metrics.scrape)

    async def metrics(request: web.Request) -> web.Response:
        body = await metrics_build.get()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    services_build = SharedBuild(lambda: encoded_rows(view.services))
    flows_build = SharedBuild(lambda: encoded_rows(view.flows))

    async def services(request: web.Request) -> web.StreamResponse:
        return await _send_json(request, await services_build.get())

    async def flows(request: web.Request) -> web.StreamResponse:
        return await _send_json(request, await flows_build.get())

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/services", services)
    app.router.add_get("/flows", flows)
    web_view.add_routes(app, view)


def connection_limit(nofile: int) -> int:
    """Connections one admin listener may hold under a descriptor limit of `nofile`."""
    return max(4, min(MAX_CONNECTIONS, nofile // FD_SHARE))


class Refused(asyncio.Protocol):
    """A connection over the limit: reset at once (SO_LINGER 0), holding nothing."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        reset(cast(asyncio.Transport, transport))  # a TCP connection's: it has abort()


def client_share(limit: int) -> int:
    """Connections one client address may hold of a listener's `limit`: half, so that one client's
    idle connections leave room for a load balancer's probe."""
    return max(1, limit // 2)


def _peer_ip(handler: object) -> str | None:
    transport = getattr(handler, "transport", None)
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if peer else None


def idle_deadline(handler: object) -> float | None:
    """When aiohttp's idle timer would close `handler`'s connection (loop time, seconds): IDLE_TIMEOUT
    after it opened or answered its last request. None while it has a request in flight (a complete
    head read, its answer not yet written), before its handler started, or once it is closing.
    Read from aiohttp's RequestHandler as its keep-alive timer reads it (web_protocol.py,
    `_process_keepalive`: idle while `_waiter`, the wait for the next head, is pending); an aiohttp
    without those fields reads as in flight: nothing is closed early, the bound still holds."""
    if getattr(handler, "transport", None) is None:
        return None
    waiter = getattr(handler, "_waiter", None)
    deadline = getattr(handler, "_next_keepalive_close_time", None)
    if not isinstance(waiter, asyncio.Future) or waiter.done() or not isinstance(deadline, float):
        return None
    return deadline


def longest_idle(handlers: list[web.RequestHandler]) -> web.RequestHandler | None:
    """The handler of `handlers` idle the longest (earliest `idle_deadline`); None when every one
    has a request in flight."""
    idle = [(d, i) for i, h in enumerate(handlers) if (d := idle_deadline(h)) is not None]
    return handlers[min(idle)[1]] if idle else None


class Gate(asyncio.Protocol):
    """A new admin connection, admitted in `connection_made` once its peer is known: handed to
    aiohttp's handler (`set_protocol`, before any byte is read), after closing the connection idle
    the longest when the listener's limit or the address's share is full; reset (`Refused`) when
    no such connection is idle."""

    def __init__(self, server: web.Server, limit: int, where: str) -> None:
        self.server = server
        self.limit = limit
        self.where = where

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if peer else None
        held = [h for h in self.server.connections if h.transport is not None]  # not closing
        mine = [h for h in held if _peer_ip(h) == ip]
        if len(mine) >= client_share(self.limit):
            room = self._make_room(mine, f"{ip} holds {client_share(self.limit)} connections")
        elif len(held) >= self.limit:
            room = self._make_room(held, f"{self.limit} connections open")
        else:
            room = True
        if not room:
            Refused().connection_made(transport)
            return
        handler = self.server()
        transport.set_protocol(handler)
        handler.connection_made(transport)

    def _make_room(self, candidates: list[web.RequestHandler], why: str) -> bool:
        """Close the connection of `candidates` idle the longest; False when none is idle."""
        victim = longest_idle(candidates)
        if victim is None:
            limited.warning("admin %s: %s, each with a request in flight; refusing more", self.where, why)
            return False
        limited.warning("admin %s: %s; closing the one idle the longest", self.where, why)
        victim.force_close()
        return True


def bounded(server: web.Server, limit: int, where: str) -> Callable[[], asyncio.Protocol]:
    """A protocol factory serving through `server`, within `limit` connections and
    `client_share(limit)` per address, making room by closing idle connections (`Gate`)."""
    return lambda: Gate(server, limit, where)


class AdminServer:
    """Runs the healthz and metrics listeners; `start()` binds, `stop()` releases."""

    def __init__(self, view: AdminView, healthz: str, metrics: str, *,
                 max_connections: int | None = None) -> None:
        """`max_connections` per listener; None: `connection_limit` of the soft RLIMIT_NOFILE
        when the server starts (after the relay raised it)."""
        self.view = view
        self.max_connections = max_connections
        self._listeners: list[asyncio.AbstractServer] = []
        self.addrs = {"healthz": host_port.bind_address(healthz) if healthz else None,
                      "metrics": host_port.bind_address(metrics) if metrics else None}
        self._runners: list[web.AppRunner] = []
        self.bound: dict[str, tuple[str, int]] = {}
        self.send_watch = SendWatch(self._connections, "healthz/metrics")

    async def start(self) -> None:
        apps: dict[tuple[str, int], web.Application] = {}
        for role, addr in self.addrs.items():
            if addr is None:
                continue
            app = apps.setdefault(addr, web.Application())
            (health_routes if role == "healthz" else metrics_routes)(app, self.view)
        limit = self.max_connections or connection_limit(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        for addr, app in apps.items():
            real = await self._serve(addr, app, limit)
            for role, a in self.addrs.items():
                if a == addr:
                    self.bound[role] = real
        if apps:
            self.send_watch.start()

    def _connections(self) -> list[web.RequestHandler]:
        return [h for r in self._runners if r.server is not None for h in r.server.connections]

    async def _serve(self, addr: tuple[str, int], app: web.Application, limit: int) -> tuple[str, int]:
        """Serve `app` on `addr`, at most `limit` connections; returns the bound address."""
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_TIMEOUT,
                               max_line_size=MAX_HEAD_LINE, max_field_size=MAX_HEAD_LINE)
        await runner.setup()
        self._runners.append(runner)
        assert runner.server is not None
        where = "/".join(role for role, a in self.addrs.items() if a == addr)
        try:
            listener = await asyncio.get_running_loop().create_server(
                bounded(runner.server, limit, where), addr[0], addr[1], reuse_address=True)
        except OSError as err:  # one line saying which flag, not a traceback
            flags = " and ".join(f"--{role}-bind-address" for role, a in self.addrs.items() if a == addr)
            hint = (" (another kube-proxy or usproxy serves it? stop it, or give another port)"
                    if err.errno == errno.EADDRINUSE else "")
            reason = err.strerror if isinstance(err, socket.gaierror) or not err.errno else os.strerror(err.errno)
            raise CannotRun(f"{flags} {format_hostport(addr[0], addr[1])}: cannot listen: "
                            f"{reason or err}{hint}") from None
        self._listeners.append(listener)
        socks = list(listener.sockets or [])
        real = socks[0].getsockname()[:2] if socks else addr
        return (str(real[0]), int(real[1]))

    async def stop(self) -> None:
        await self.send_watch.stop()
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
