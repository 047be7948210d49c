"""A fake kube-apiserver (aiohttp) that speaks the real list/watch protocol, with fault switches.

Serves Services, discovery.k8s.io/v1 EndpointSlices and Nodes, cluster-wide, on 127.0.0.1:
- lists: `kind: <Kind>List`, `metadata.resourceVersion`, paging by `limit`/`continue`;
- watches (`?watch=true&resourceVersion=N&allowWatchBookmarks=true&timeoutSeconds=S`): the events
  after N from its history, then live events, BOOKMARKs every `bookmark_interval`, and the end of
  the stream after S seconds; a resourceVersion older than the last compaction gets HTTP 200 and
  one ERROR event carrying Status 410 Expired, as the watch cache answers;
- `labelSelector` (`key`, `!key`, `key=v`, `key!=v`) and `fieldSelector` (`metadata.name=`,
  `metadata.namespace=`); an object leaving a watch's selection is sent as DELETED;
- a bearer token, when `token` is set (401 Status otherwise);
- RBAC, when `rbac` is set (tests/sources/fake_rbac.py): each token of `users` is a user with
  groups, and a list or watch its roles do not allow gets the real server's 403.

One resourceVersion counter is shared by every resource, as etcd's revision. Faults (see
`Faults`) are switched on by tests; the counted ones switch themselves off once used.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.sources.fake_rbac import Rbac

Obj = dict[str, Any]
Key = tuple[str, str]

RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    # name: (path, Kind, apiVersion, namespaced)
    "services": ("/api/v1/services", "Service", "v1", True),
    "endpointslices": ("/apis/discovery.k8s.io/v1/endpointslices", "EndpointSlice", "discovery.k8s.io/v1", True),
    "nodes": ("/api/v1/nodes", "Node", "v1", False),
    "servicecidrs": ("/apis/networking.k8s.io/v1/servicecidrs", "ServiceCIDR", "networking.k8s.io/v1", False),
}

HTML_PAGE = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
             b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


@dataclass
class Faults:
    """Switches; counters count requests (of the resources in `only`, or all when empty)."""

    delay: float = 0.0  # sleep before answering any request
    html_error: int = 0  # answer the next N requests 502 with an HTML page (a proxy in the way)
    html_ok: int = 0  # answer the next N requests 200 with an HTML page
    status_error: int = 0  # answer the next N requests 500 with a Status body
    gone_in_stream: int = 0  # the next N watches: 200, then an ERROR event with Status 410
    gone_status: int = 0  # the next N watches: HTTP 410 with a Status body
    cut_event: int = 0  # the next N watch events: half of the line is written, then the connection cut
    stall: int = 0  # the next N watches: headers, then silence (no bookmarks) until timeout
    end_at_once: int = 0  # the next N watches: 200 and an empty body
    expire_continue: int = 0  # the next N continue tokens are too old (410 Expired)
    forbidden: set[str] = field(default_factory=set)  # resources answering 403
    missing: set[str] = field(default_factory=set)  # resources answering 404 (an older API server)
    only: set[str] = field(default_factory=set)

    def take(self, name: str, resource: str) -> bool:
        """Use one count of fault `name` if it is armed for `resource`."""
        if self.only and resource not in self.only:
            return False
        n = getattr(self, name)
        if n:
            setattr(self, name, n - 1)
            return True
        return False


@dataclass
class Event:
    rv: int
    type: str
    obj: Obj
    old: Obj | None


def _selector_match(obj: Obj, labels_sel: str, fields_sel: str) -> bool:
    meta = obj.get("metadata", {})
    labels = meta.get("labels") or {}
    for req in filter(None, labels_sel.split(",")):
        if req.startswith("!"):
            ok = req[1:] not in labels
        elif "!=" in req:
            k, v = req.split("!=", 1)
            ok = labels.get(k) != v
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            ok = labels.get(k) == v
        else:
            ok = req in labels
        if not ok:
            return False
    for req in filter(None, fields_sel.split(",")):
        k, v = req.replace("==", "=").split("=", 1)
        if meta.get(k.removeprefix("metadata.")) != v:
            return False
    return True


def status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeApiServer:
    """The fake server. `start()` binds `host` (127.0.0.1 unless told; the same port again after
    `stop()`)."""

    def __init__(self, *, bookmark_interval: float = 0.3, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1",
                 rbac: Rbac | None = None, users: dict[str, tuple[str, tuple[str, ...]]] | None = None) -> None:
        """`users`: bearer token -> (user name, groups), who RBAC (`rbac`) authorizes."""
        self.host = host
        self.rbac = rbac
        self.users = users or {}
        self.denied: list[str] = []  # the 403 messages sent by RBAC
        self.rv = 100
        self.ssl_context = ssl_context  # HTTPS when given (the in-cluster configuration needs it)
        self.objects: dict[str, dict[Key, Obj]] = {r: {} for r in RESOURCES}
        self.history: dict[str, list[Event]] = {r: [] for r in RESOURCES}
        self.compacted = 0
        self.bookmark_interval = bookmark_interval
        self.token = token
        self.faults = Faults()
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.port = 0
        self._queues: set[asyncio.Queue[Event | None]] = set()
        self._snapshots: dict[str, tuple[int, list[Obj]]] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        for name, (path, *_rest) in RESOURCES.items():
            app.router.add_get(path, self._handler(name))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, ssl_context=self.ssl_context)
        await site.start()
        server: Any = site._server
        self.port = server.sockets[0].getsockname()[1]

    def end_streams(self) -> None:
        """End every open watch cleanly (as at its timeout); clients watch again."""
        for q in list(self._queues):
            q.put_nowait(None)

    async def stop(self) -> None:
        """Go away: end every stream, close the port (connections are refused until start())."""
        self.end_streams()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, *, lose_history: bool = True) -> None:
        """A restarted API server: same objects (etcd kept them), old watch positions expired."""
        await self.stop()
        if lose_history:
            self.compact()
        await self.start()

    # -- state ----------------------------------------------------------------------------------
    def apply(self, resource: str, obj: Obj) -> Obj:
        """Create or replace an object (a copy is stored with a new resourceVersion)."""
        _, kind, api_version, namespaced = RESOURCES[resource]
        obj = json.loads(json.dumps(obj))
        meta = obj.setdefault("metadata", {})
        if namespaced:
            meta.setdefault("namespace", "default")
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version)
        key = (meta.get("namespace", ""), meta["name"])
        old = self.objects[resource].get(key)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[resource][key] = obj
        self._record(resource, Event(self.rv, "MODIFIED" if old else "ADDED", obj, old))
        return obj

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        key = (namespace if RESOURCES[resource][3] else "", name)
        old = self.objects[resource].pop(key)
        self.rv += 1
        gone = json.loads(json.dumps(old))
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record(resource, Event(self.rv, "DELETED", gone, old))

    def replace_all(self, resource: str, objs: list[Obj]) -> None:
        """Make `objs` the whole set, with no events (as if they changed while nobody watched)."""
        self.objects[resource] = {}
        for o in objs:
            self.apply(resource, o)
        self.history[resource] = []
        self.compact()

    def compact(self) -> None:
        """Forget the history: watches from any earlier resourceVersion get 410."""
        self.rv += 1
        self.compacted = self.rv
        for h in self.history.values():
            h.clear()
        self._snapshots.clear()

    def _record(self, resource: str, ev: Event) -> None:
        ev.obj.setdefault("__resource__", resource)
        self.history[resource].append(ev)
        for q in list(self._queues):
            q.put_nowait(ev)

    # -- HTTP -----------------------------------------------------------------------------------
    def _handler(self, resource: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            q = dict(request.query)
            self.requests.append((resource, q))
            if self.faults.delay:
                await asyncio.sleep(self.faults.delay)
            early = self._early_answer(request, resource)
            if early is not None:
                return early
            if q.get("watch") in ("true", "1"):
                return await self._watch(request, resource, q)
            return await self._list(resource, q)
        return handle

    def _early_answer(self, request: web.Request, resource: str) -> web.Response | None:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if self.rbac is not None:
            return self._authorize(request, resource)
        return self._faulty(resource)

    def _authorize(self, request: web.Request, resource: str) -> web.Response | None:
        who = self.users.get(request.headers.get("Authorization", "").removeprefix("Bearer "))
        if who is None:
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        assert self.rbac is not None
        path = RESOURCES[resource][0]
        group = "" if path.startswith("/api/") else path.split("/")[2]
        verb = "watch" if request.query.get("watch") in ("true", "1") else "list"
        why = self.rbac.denied(who[0], who[1], group, resource, verb)
        if why is not None:
            self.denied.append(why)
            return web.json_response(status(403, "Forbidden", why), status=403)
        return self._faulty(resource)

    def _faulty(self, resource: str) -> web.Response | None:
        if resource in self.faults.missing:
            return web.json_response(status(404, "NotFound", "the server could not find the requested resource"),
                                     status=404)
        if resource in self.faults.forbidden:
            return web.json_response(status(403, "Forbidden", f"{resource} is forbidden: User cannot list"),
                                     status=403)
        if self.faults.take("html_error", resource):
            return web.Response(body=HTML_PAGE, status=502, content_type="text/html")
        if self.faults.take("html_ok", resource):
            return web.Response(body=HTML_PAGE, status=200, content_type="text/html")
        if self.faults.take("status_error", resource):
            return web.json_response(status(500, "InternalError", "etcdserver: request timed out"), status=500)
        return None

    def _visible(self, resource: str, q: dict[str, str], obj: Obj | None) -> bool:
        return obj is not None and _selector_match(obj, q.get("labelSelector", ""), q.get("fieldSelector", ""))

    async def _list(self, resource: str, q: dict[str, str]) -> web.Response:
        _, kind, api_version, _ = RESOURCES[resource]
        token = q.get("continue")
        if token:
            snap = self._snapshots.get(token.split(":")[0])
            if snap is None or self.faults.take("expire_continue", resource):
                return web.json_response(status(410, "Expired", "The provided continue parameter is too old"),
                                         status=410)
            rv, items = snap
            offset = int(token.split(":")[1])
        else:
            rv = self.rv
            items = [_clean(o) for _, o in sorted(self.objects[resource].items()) if self._visible(resource, q, o)]
            offset = 0
        limit = int(q.get("limit") or 0) if q.get("resourceVersion") != "0" else 0
        page, cont = items[offset:], ""
        if limit and len(page) > limit:
            page = page[:limit]
            snap_id = base64.urlsafe_b64encode(f"{rv}-{time.monotonic_ns()}".encode()).decode()
            self._snapshots[snap_id] = (rv, items)
            cont = f"{snap_id}:{offset + limit}"
        meta = {"resourceVersion": str(rv), **({"continue": cont} if cont else {})}
        head = {"kind": f"{kind}List", "apiVersion": api_version, "metadata": meta}
        # Encoded in a thread an item at a time: the server shares the process (and the GIL) with
        # the client under test, whose loop stall tests must measure only the client.
        body = await asyncio.to_thread(_encode_list, head, page)
        return web.Response(body=body, content_type="application/json")

    async def _watch(self, request: web.Request, resource: str, q: dict[str, str]) -> web.StreamResponse:
        if self.faults.take("gone_status", resource):
            return web.json_response(status(410, "Expired", "too old resource version"), status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        rv = int(q.get("resourceVersion") or 0)
        if self.faults.take("end_at_once", resource):
            return resp
        if self.faults.take("gone_in_stream", resource) or (rv and rv < self.compacted):
            await _send(resp, "ERROR", status(410, "Expired", f"too old resource version: {rv} ({self.compacted})"))
            return resp
        stream = _Stream(self, request, resp, resource, q)
        await stream.run(rv, float(q.get("timeoutSeconds") or 1800))
        return resp


class _Stream:
    """One watch stream: backlog, live events, bookmarks, faults."""

    def __init__(self, server: FakeApiServer, request: web.Request, resp: web.StreamResponse,
                 resource: str, q: dict[str, str]) -> None:
        self.server = server
        self.request = request
        self.resp = resp
        self.resource = resource
        self.q = q
        self.bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        self.stall = server.faults.take("stall", resource)

    async def run(self, rv: int, timeout: float) -> None:
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self.server._queues.add(queue)  # registered with the backlog read: no event is missed
        try:
            backlog = [e for e in self.server.history[self.resource] if e.rv > rv] if rv else [
                Event(self.server.rv, "ADDED", o, None) for o in self.server.objects[self.resource].values()]
            for ev in [] if self.stall else backlog:
                if not await self._event(ev):
                    return
            await self._live(queue, time.monotonic() + timeout)
        finally:
            self.server._queues.discard(queue)

    async def _live(self, queue: asyncio.Queue[Event | None], deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = await asyncio.wait_for(queue.get(), min(left, self.server.bookmark_interval))
            except TimeoutError:
                if self.bookmarks and not self.stall:
                    await _send(self.resp, "BOOKMARK", self._bookmark())
                continue
            if ev is None:
                return
            if not self.stall and not await self._event(ev):
                return

    def _bookmark(self) -> Obj:
        _, kind, api_version, _ = RESOURCES[self.resource]
        return {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self.server.rv)}}

    async def _event(self, ev: Event) -> bool:
        """Send one event (as the selector sees it); False once the stream was cut."""
        if ev.obj.get("__resource__") != self.resource:
            return True
        now, before = self.server._visible(self.resource, self.q, ev.obj), self.server._visible(self.resource, self.q, ev.old)
        kind = ev.type
        if ev.type == "MODIFIED" and now != before:
            kind = "ADDED" if now else "DELETED"
        elif not (now or (ev.type == "DELETED" and before)):
            return True
        if self.server.faults.take("cut_event", self.resource):
            line = json.dumps({"type": kind, "object": _clean(ev.obj)}).encode()
            await self.resp.write(line[: len(line) // 2])
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            return False
        await _send(self.resp, kind, _clean(ev.obj))
        return True


def _encode_list(head: Obj, items: list[Obj]) -> bytes:
    """json.dumps({**head, "items": items}), one item per json.dumps call."""
    parts = [json.dumps(head)[:-1], ', "items": [', ", ".join(json.dumps(o) for o in items), "]}"]
    return "".join(parts).encode()


def _clean(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k != "__resource__"}


async def _send(resp: web.StreamResponse, kind: str, obj: Obj) -> None:
    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


def kubeconfig_text(url: str, token: str | None = None) -> str:
    """A kubeconfig for the fake server (plain HTTP on loopback)."""
    user = f"    token: {token}\n" if token else "    {}\n"
    return (
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
        "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n"
        f"users:\n- name: fake\n  user:\n{user}"
    )
