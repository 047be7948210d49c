"""WebView: the live page of the node, served by the agent next to /metrics (same listener).

Read-only. Routes:
- GET /view: the page (usproxy/admin/static/view.html, .js, .css; nothing from the internet).
- GET /view/static/{file}: those files only, and usproxy/explain/static/explain.css (the page's
  base and the drawings' styles, shared with `usproxy explain --html`'s standalone page).
- GET /view/stream: server-sent events: "snapshot" (every ServicePort as /services shows it,
  and the flow table as /flows shows it, at most MAX_FLOWS rows plus the total) every
  SNAPSHOT_PERIOD seconds while some page is open (longer when building one takes long; built
  in chunks on the loop and encoded in a worker thread, as /services), and
  "offloaded" / "demoted" / "userspace" as the offload manager publishes them
  (usproxy.core.events); "lagged" with the count of events a slow page missed.
- GET /view/service?name=NS/NAME: per mode, the SVG drawings of that Service's ports and the
  rules the mode holds for it (usproxy/explain/mode_view.py, imported on the first such request:
  an agent nobody asks never loads usproxy.explain), and for nftables usproxy's own table as the
  kernel lists it now (`nft list table`, read again after each sync of the agent and at least
  every LIVE_TABLE_AGE seconds, however many Services pages ask for meanwhile), drawn and quoted
  next to kube-proxy's. The page asks for a Service's drawings when it is opened.
- GET /view/numbers: "why, in numbers" for every ServicePort of the node, measured as
  `explain --scale` measures (usproxy/explain/page_sections.py), in a worker thread, one
  measurement at a time; the page asks when its section is opened.
- GET /view/tour: the plots of the tour's results directory (`usproxy run --tour-results DIR`)
  as HTML, or null without one.
The page itself carries the introduction both pages share (page_sections.intro_html), made once.

The data is the agent's own: `services()` and `flows()` are what /services and /flows return. One
snapshot task serves every open page (flows are dumped once per period, not once per page); it
runs only while a page is open. At most MAX_WATCHERS streams at once (503 beyond), so pages never
take the listener's connections from /metrics; a stream whose write of a payload (written in
chunks, snapshot.write_chunked) does not finish within WRITE_TIMEOUT seconds (a stalled browser)
is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from aiohttp import web

from usproxy.core.events import Event, EventHub
from usproxy.admin.snapshot import free, rows_json, write_chunked
from usproxy.core.datapath import ServicePortState
from usproxy.util.gc_pause import gc_paused
from usproxy.model.node import NodeFacts
from usproxy.model.types import NamespacedName
from usproxy.util.rows import FlowRow, ServiceRow

if TYPE_CHECKING:
    from usproxy.model.service_set import ServiceSet

log = logging.getLogger(__name__)

SNAPSHOT_PERIOD = 0.5  # seconds between two snapshots while a page is open
LIVE_TABLE_AGE = 2.0  # seconds one reading of usproxy's nftables tables serves every Service asked
HEARTBEAT = 15.0  # seconds of silence after which a comment line keeps the stream open
WRITE_TIMEOUT = 10.0  # seconds writing one payload to a page may take before the page is dropped
MAX_WATCHERS = 8  # streams at once
MAX_FLOWS = 500  # flow rows per snapshot (the total is sent too)
ASSETS = {  # file: (package holding static/file, content type)
    "view.js": ("usproxy.admin", "application/javascript"),
    "view.css": ("usproxy.admin", "text/css"),
    "explain.css": ("usproxy.explain", "text/css"),
}


@runtime_checkable
class WebSource(Protocol):
    """What the page reads from the agent (usproxy.app.agent.Agent is one)."""

    events: EventHub
    node: NodeFacts

    async def services(self) -> list[ServiceRow]: ...

    async def flows(self) -> list[FlowRow]: ...

    def service_ports(self, service: NamespacedName | None = None) -> list[ServicePortState]: ...


def asset(name: str, package: str = "usproxy.admin") -> str:
    """The text of one file of `package`'s static/ folder (shipped as package data)."""
    return resources.files(package).joinpath("static", name).read_text(encoding="utf-8")


def service_set_of(source: WebSource, namespace: str | None = None, name: str = "") -> ServiceSet | None:
    """The ServicePorts of one Service (every Service's when `namespace` is None) with their
    endpoints now (read on the loop, where the agent's state lives), as explain's views take
    them; None when no ServicePort of it is known."""
    from usproxy.model.service_set import Node, ServiceSet

    which = None if namespace is None else NamespacedName(namespace, name)
    ports = tuple((st.service_port, st.endpoints) for st in source.service_ports(which))
    return ServiceSet(ports, Node(name=source.node.name)) if ports else None


def intro_html() -> str:
    """The introduction both pages share (imports usproxy.explain: called in a thread)."""
    from usproxy.explain.page_sections import intro_html as intro

    return intro()


def live_tables() -> dict[int, str]:
    """usproxy's nftables tables as the kernel lists them now, by IP family (none when nft is
    missing or no table exists). Blocking: called in a thread."""
    from usproxy.explain.live import nft_tables

    return {4 if family == "ip" else 6: text for family, text in nft_tables()}


class WebView:
    """The routes above over one WebSource; `add_to(app)` registers them. `tour`: the tour's
    results directory whose plots /view/tour shows, if any."""

    def __init__(self, source: WebSource, tour: Path | None = None) -> None:
        self.source = source
        self.tour = tour
        self.streams: set[asyncio.Task[Any]] = set()
        self._snapshots: asyncio.Task[None] | None = None
        self._encode = SseEncoder()
        self._page: str | None = None
        self._live: tuple[float, object, dict[int, str]] | None = None  # (read at, sync mark, tables)
        self._live_lock = asyncio.Lock()
        self._measuring = asyncio.Lock()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/view", self.page)
        app.router.add_get("/view/static/{file}", self.static)
        app.router.add_get("/view/stream", self.stream)
        app.router.add_get("/view/service", self.service)
        app.router.add_get("/view/numbers", self.numbers)
        app.router.add_get("/view/tour", self.tour_plots)
        app.on_shutdown.append(self._shutdown)

    async def page(self, request: web.Request) -> web.Response:
        if self._page is None:  # the introduction is explain's: made once, off the loop
            self._page = asset("view.html").replace("<!--intro-->", await asyncio.to_thread(intro_html))
        return web.Response(text=self._page, content_type="text/html")

    async def _live_tables(self) -> dict[int, str] | None:
        """usproxy's tables as last read, read again when older than LIVE_TABLE_AGE or when the
        agent has synced since (a sync is what changes them: the agent says when it last synced,
        `last_sync()`); None when this agent runs no nftables datapath (nothing of it to read;
        the agent says which it runs, `kernel_datapaths()`)."""
        running = getattr(self.source, "kernel_datapaths", None)
        if not callable(running) or "nftables" not in running():
            return None
        synced = getattr(self.source, "last_sync", None)
        mark = synced() if callable(synced) else None
        async with self._live_lock:
            if self._live is None or time.monotonic() - self._live[0] > LIVE_TABLE_AGE or self._live[1] != mark:
                self._live = (time.monotonic(), mark, await asyncio.to_thread(live_tables))
            return self._live[2]

    async def numbers(self, request: web.Request) -> web.Response:
        from usproxy.explain.page_sections import numbers_html  # loads usproxy.explain

        ss = service_set_of(self.source)
        if ss is None:
            return web.json_response({"html": "<p>No Services yet.</p>"})
        async with self._measuring:  # one measurement at a time, however often it is asked
            html = await asyncio.to_thread(numbers_html, ss)
        return web.json_response({"html": html})

    async def tour_plots(self, request: web.Request) -> web.Response:
        if self.tour is None:
            return web.json_response({"html": None})
        from usproxy.explain.page_sections import tour_html

        return web.json_response({"html": await asyncio.to_thread(tour_html, self.tour)})

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["file"]
        if name not in ASSETS:
            raise web.HTTPNotFound()
        package, content_type = ASSETS[name]
        return web.Response(text=asset(name, package), content_type=content_type)

    async def service(self, request: web.Request) -> web.Response:
        namespace, _, name = request.query.get("name", "").partition("/")
        from usproxy.explain.mode_view import mode_views  # loads usproxy.explain

        ss = service_set_of(self.source, namespace, name)
        if ss is None:
            raise web.HTTPNotFound(text=f"no Service {namespace}/{name}\n")
        live = await self._live_tables()
        # Values only from here: rendered in a thread, as a Service of 10,000 endpoints renders
        # 10,000 rules per mode.
        modes = await asyncio.to_thread(mode_views, ss, live)
        return web.json_response({"service": f"{namespace}/{name}", "modes": modes})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if len(self.streams) >= MAX_WATCHERS:
            raise web.HTTPServiceUnavailable(text=f"at most {MAX_WATCHERS} pages at once\n")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        me = asyncio.current_task()
        assert me is not None
        self.streams.add(me)
        sub = self.source.events.subscribe()
        self._ensure_snapshots()
        told = 0  # events dropped for this page that it was told about
        try:
            while True:
                events = await sub.next(timeout=HEARTBEAT)
                payload = [part for ev in events for part in self._encode(ev)] or [b": keep-alive\n\n"]
                if sub.dropped > told:  # the page fell behind: say how many events it missed
                    told = sub.dropped
                    payload.append(f"event: lagged\ndata: {json.dumps({'dropped': told})}\n\n".encode())
                await asyncio.wait_for(write_chunked(resp, payload), WRITE_TIMEOUT)  # a snapshot is MBs
        except (ConnectionError, TimeoutError):
            pass  # the page went away or stalled: drop it
        finally:
            sub.close()
            self.streams.discard(me)
        return resp

    def _ensure_snapshots(self) -> None:
        if self._snapshots is None or self._snapshots.done():
            self._snapshots = asyncio.create_task(self._snapshot_loop(), name="web-view-snapshots")

    async def _snapshot_loop(self) -> None:
        """One snapshot per period while some page is open; ends when none is."""
        hub = self.source.events
        while hub.subscribers:
            start = time.monotonic()
            try:
                encoded = await self._snapshot()
            except Exception:
                log.exception("web view: building a snapshot failed")
            else:
                hub.publish_encoded("snapshot", encoded)
            # A big table (dumping kernel conntrack takes ~0.3 s per 1,000 entries) is read at most
            # a third of the time, so an open page never keeps the agent busy.
            await asyncio.sleep(max(SNAPSHOT_PERIOD, 2 * (time.monotonic() - start)))

    async def _snapshot(self) -> bytes:
        """The snapshot's data as JSON text: {"services": /services' rows, "flows": at most
        MAX_FLOWS of /flows' rows, "flowCount": how many flows there are}. The rows are built
        on the loop in chunks, encoded and freed in a worker thread, with the collector paused
        (as usproxy.admin.snapshot.encoded_rows)."""
        with gc_paused(True):
            services = await self.source.services()
            return await asyncio.to_thread(snapshot_json, services, await self.source.flows())

    async def _shutdown(self, app: web.Application) -> None:
        """Close open streams so the admin server stops at once."""
        tasks = [*self.streams, *([self._snapshots] if self._snapshots else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def snapshot_json(services: list[ServiceRow], flows: list[FlowRow]) -> bytes:
    """`json.dumps({"services": services, "flows": flows[:MAX_FLOWS], "flowCount": len(flows)})`
    as UTF-8, a row at a time (rows_json: for a worker thread); both lists are emptied
    (snapshot.free)."""
    members = (f'"services": {rows_json(services)}', f'"flows": {rows_json(flows[:MAX_FLOWS])}',
               f'"flowCount": {len(flows)}')
    free(services)
    free(flows)
    return ("{" + ", ".join(members) + "}").encode()


class SseEncoder:
    """The server-sent event bytes of an Event in parts to send in turn, encoded once however many
    pages read it: the last ENCODED events are kept (a snapshot of a big table is costly to
    encode). The parts are not joined: a 3 MB snapshot copied on the loop held it ~2-5 ms."""

    ENCODED = 32

    def __init__(self) -> None:
        self._cache: OrderedDict[int, list[bytes | memoryview]] = OrderedDict()

    def __call__(self, ev: Event) -> list[bytes | memoryview]:
        out = self._cache.get(ev.seq)
        if out is None:
            out = self._cache[ev.seq] = [f"event: {ev.kind}\ndata: ".encode(), *ev.json_parts(), b"\n\n"]
            if len(self._cache) > self.ENCODED:
                self._cache.popitem(last=False)
        return out


def add_routes(app: web.Application, view: object) -> None:
    """Serve the page from `app` when `view` can feed it (the agent can; test fakes may not),
    with the tour's plots when `view` names a results directory (`tour_results`)."""
    if isinstance(view, WebSource):
        tour = getattr(view, "tour_results", None)
        WebView(view, tour if isinstance(tour, Path) else None).add_to(app)
