"""The admin HTTP servers (aiohttp).

healthz address (default 0.0.0.0:10256): /healthz and /livez, kube-proxy's JSON body, 200 or 503.
metrics address (default 127.0.0.1:10249): /metrics (Prometheus text), /services and /flows (JSON).
When both addresses are equal one server serves every path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from usproxy.admin.health import Health
from usproxy.metrics import Metrics


class AdminView(Protocol):
    """What the admin server reads from the agent."""

    metrics: Metrics

    def health(self) -> Health: ...

    def services_view(self) -> list[dict[str, Any]]: ...

    async def flows(self) -> list[dict[str, Any]]: ...


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body, indent=1) + "\n", status=status, content_type="application/json")


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
    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(view.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def services(request: web.Request) -> web.Response:
        return _json(view.services_view())

    async def flows(request: web.Request) -> web.Response:
        return _json(await view.flows())

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/services", services)
    app.router.add_get("/flows", flows)


def split_hostport(text: str, flag: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" → (host, port). Raises ValueError naming the flag."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag}: expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class AdminServer:
    """Runs the healthz and metrics listeners; `start()` binds, `stop()` releases."""

    def __init__(self, view: AdminView, healthz: str, metrics: str) -> None:
        self.view = view
        self.addrs = {"healthz": split_hostport(healthz, "--healthz-bind-address") if healthz else None,
                      "metrics": split_hostport(metrics, "--metrics-bind-address") if metrics else None}
        self._runners: list[web.AppRunner] = []
        self.bound: dict[str, tuple[str, int]] = {}

    async def start(self) -> None:
        apps: dict[tuple[str, int], web.Application] = {}
        for role, addr in self.addrs.items():
            if addr is None:
                continue
            app = apps.setdefault(addr, web.Application())
            (health_routes if role == "healthz" else metrics_routes)(app, self.view)
        for addr, app in apps.items():
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, addr[0], addr[1], reuse_address=True)
            await site.start()
            self._runners.append(runner)
            server: Any = site._server
            socks = list(getattr(server, "sockets", None) or [])
            real = socks[0].getsockname()[:2] if socks else addr
            for role, a in self.addrs.items():
                if a == addr:
                    self.bound[role] = (str(real[0]), int(real[1]))

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
