"""Reflector: keep a Store equal to one API resource by list, then watch (client-go tools/cache).

The loop follows client-go's reflector.go ListAndWatch:
- list (paged), `Store.replace()` with every item, remember the list's resourceVersion;
- watch from that resourceVersion with `allowWatchBookmarks` and a randomised server-side timeout
  in [min_watch_timeout, 2 × min_watch_timeout), applying ADDED/MODIFIED/DELETED to the Store and
  moving the resourceVersion forward on every event, BOOKMARK included;
- a watch that ends cleanly is resumed from the last resourceVersion, without listing;
- 410 Gone (an HTTP status, or an ERROR event carrying Status code 410 inside a 200 stream) means
  the resourceVersion was compacted away: list again;
- connection errors, dropped streams, read timeouts, error pages and malformed bodies back off
  exponentially (0.8 s doubling to 30 s, jittered, as client-go's backoff manager) and resume.

Invariants: the Store only ever hears what the server said. Failures never reach it, so a
reflector that cannot reach its server leaves the last known state in place; only a successful
relist can remove objects (those that vanished between the two lists).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import aiohttp

from usproxy.util.errors import SourceError

log = logging.getLogger(__name__)

RawObject = Mapping[str, Any]


# metav1.ListMeta ("continue" is a Python keyword, hence the functional form)
ListMeta = TypedDict("ListMeta", {"resourceVersion": str, "continue": str}, total=False)


class ListBody(TypedDict, total=False):
    """A list response (ServiceList, EndpointSliceList, NodeList)."""

    kind: str
    metadata: ListMeta
    items: list[dict[str, Any]]


class WatchEvent(TypedDict):
    """One line of a watch stream (metav1.WatchEvent)."""

    type: str
    object: dict[str, Any]


class ApiError(SourceError):
    """The API server answered with an error; `status` is the HTTP or Status code (0: unknown)."""

    def __init__(self, message: str, status: int = 0) -> None:
        self.status = status
        super().__init__(message)


class Gone(ApiError):
    """410 Gone / Expired: the requested resourceVersion is too old; the reflector relists."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 410)


# What a ListWatch may make of each listed item as it decodes it (kube.ObjectCache.read: the
# parse, in the decoding thread); pure, since it runs off the loop.
ItemReader = Callable[[dict[str, Any]], object]


@dataclass(frozen=True, slots=True)
class ListResult:
    """Every item of a (possibly paged) list and the resourceVersion it was read at. The items
    are raw objects, or what the ListWatch's ItemReader made of them: its Store's own reader."""

    items: list[Any]
    resource_version: str


class ListWatch(Protocol):
    """How a Reflector reaches its resource (client-go cache.ListerWatcher)."""

    async def list(self, resource_version: str) -> ListResult:
        """All items; raises Gone when `resource_version` is no longer available."""

    def watch(self, resource_version: str, timeout: float) -> AsyncGenerator[WatchEvent, None]:
        """Events after `resource_version`; ends when the server ends the stream."""


class Store(Protocol):
    """What a Reflector keeps up to date (client-go cache.Store, reduced to what a proxy needs)."""

    async def replace(self, items: list[Any]) -> None:
        """The complete current set (ListResult.items): objects not in `items` are gone. Async so
        that a large list is applied with the loop running between pieces of it (kube.ObjectCache)."""

    def upsert(self, obj: dict[str, Any]) -> None:
        """An object was added or modified."""

    def delete(self, obj: dict[str, Any]) -> None:
        """An object was deleted (its last state)."""


@dataclass(frozen=True, slots=True)
class ReflectorOptions:
    """Timing. Defaults are client-go's; tests shrink them.

    `read_timeout` bounds silence on a watch (and the wait for any response): a watch-cache API
    server sends a BOOKMARK at least once a minute, so longer silence means a dead connection and
    the watch is resumed from the last resourceVersion, which loses nothing.
    """

    min_watch_timeout: float = 300.0
    read_timeout: float = 90.0
    list_timeout: float = 60.0
    backoff_initial: float = 0.8
    backoff_max: float = 30.0
    backoff_jitter: float = 0.2
    short_watch: float = 1.0
    page_size: int = 500


class Backoff:
    """Exponential backoff: initial, doubling to max, each delay stretched by up to `jitter`."""

    def __init__(self, initial: float, maximum: float, jitter: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay * (1 + self.jitter * random.random())

    def reset(self) -> None:
        self._next = self.initial


TRANSIENT = (SourceError, aiohttp.ClientError, TimeoutError, OSError)


class Reflector:
    """Runs list-then-watch for one resource forever, feeding `store`."""

    def __init__(self, name: str, lw: ListWatch, store: Store, options: ReflectorOptions | None = None) -> None:
        self.name = name
        self.lw = lw
        self.store = store
        self.opts = options or ReflectorOptions()
        self.backoff = Backoff(self.opts.backoff_initial, self.opts.backoff_max, self.opts.backoff_jitter)
        self.resource_version = ""
        self.rv_unavailable = False  # client-go isLastSyncResourceVersionUnavailable
        self.synced = asyncio.Event()  # set after the first successful list
        self.attempted = asyncio.Event()  # set after the first list attempt, whatever its outcome
        self.lists = 0
        self.watches = 0
        self._last_error = ""
        self._gone_streak = 0  # 410s with no watch event in between

    async def run(self) -> None:
        """List and watch until cancelled. Never returns; never raises except CancelledError."""
        while True:
            try:
                await self._list_and_watch()
            except Gone as err:
                await self._after_gone(err)
            except asyncio.CancelledError:
                raise
            except TRANSIENT as err:
                await self._pause(err)
            except Exception as err:  # a bug must not stop the proxy: log loudly, keep the state
                log.exception("%s: unexpected error", self.name)
                await self._pause(err)

    async def _list_and_watch(self) -> None:
        await self._list()
        while True:
            try:
                await self._watch()
            except (Gone, asyncio.CancelledError):
                raise
            except TRANSIENT as err:
                await self._pause(err)  # resume the watch from the last resourceVersion

    def relist_resource_version(self) -> str:
        """client-go relistResourceVersion: "" forces a consistent read, "0" allows the cache."""
        if self.rv_unavailable:
            return ""
        return self.resource_version or "0"

    async def _list(self) -> None:
        try:
            result = await self.lw.list(self.relist_resource_version())
        except Gone:
            self.rv_unavailable = True
            raise
        finally:
            self.attempted.set()
        self.rv_unavailable = False
        await self.store.replace(result.items)
        self.resource_version = result.resource_version
        self.lists += 1
        self._recovered()
        self.synced.set()
        log.debug("%s: listed %d objects at resourceVersion %s", self.name, len(result.items),
                  self.resource_version)

    async def _watch(self) -> None:
        timeout = self.opts.min_watch_timeout * (1 + random.random())
        started = time.monotonic()
        events = 0
        self.watches += 1
        async with aclosing(self.lw.watch(self.resource_version, timeout)) as stream:
            async for event in stream:
                self._apply(event)
                events += 1
                self._gone_streak = 0
                self.backoff.reset()
                self._recovered()
        if events == 0 and time.monotonic() - started < self.opts.short_watch:
            # client-go: "very short watch"; a server that hangs up at once must not be hammered
            raise SourceError("very short watch: the server ended it at once without events")

    def _apply(self, event: WatchEvent) -> None:
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            raise status_error(obj)
        rv = resource_version_of(obj)
        if kind in ("ADDED", "MODIFIED"):
            self.store.upsert(obj)
        elif kind == "DELETED":
            self.store.delete(obj)
        elif kind != "BOOKMARK":
            raise SourceError(f"watch event of unknown type {kind!r}")
        self.resource_version = rv

    async def _after_gone(self, err: Gone) -> None:
        """Relist at once the first time; if no event arrived since the last 410, back off first."""
        log.info("%s: %s; listing again", self.name, err)
        self._gone_streak += 1
        if self._gone_streak > 1:
            await asyncio.sleep(self.backoff.next())

    async def _pause(self, err: BaseException) -> None:
        delay = self.backoff.next()
        text = describe_error(err)
        level = logging.WARNING if text != self._last_error else logging.DEBUG
        log.log(level, "%s: %s; keeping the last known state, retrying in %.1fs", self.name, text, delay)
        self._last_error = text
        await asyncio.sleep(delay)

    def _recovered(self) -> None:
        if self._last_error:
            log.info("%s: connection to the API server restored", self.name)
        self._last_error = ""


def resource_version_of(obj: RawObject) -> str:
    """metadata.resourceVersion of an event's object; a SourceError when it has none."""
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    if not isinstance(rv, str) or not rv:
        raise SourceError("watch event without metadata.resourceVersion")
    return rv


def status_error(status: RawObject) -> ApiError:
    """A metav1.Status (from an ERROR event or an error response) as Gone or ApiError."""
    code = status.get("code")
    code = code if isinstance(code, int) else 0
    message = f"{status.get('reason') or 'Error'}: {status.get('message') or 'no message'}"
    if code == 410 or status.get("reason") in ("Expired", "Gone"):
        return Gone(message)
    return ApiError(f"API error {code}: {message}", code)


def describe_error(err: BaseException) -> str:
    """One line for the log: the error's type when its text says nothing."""
    text = " ".join(str(err).split())
    if isinstance(err, TimeoutError) and not text:
        return "timed out"
    return f"{type(err).__name__}: {text}" if not isinstance(err, SourceError) else text
