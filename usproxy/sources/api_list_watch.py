"""ApiListWatch: list and watch one API resource over kubernetes_asyncio's ApiClient, as raw dicts.

Requests go through `ApiClient.call_api` (so kubeconfig and in-cluster credentials, TLS and token
refresh all come from kubernetes_asyncio) with `_preload_content=False`: bodies are decoded here,
never deserialised into V1 models, so objects reach the model with their API field names, exactly
as the static source reads them from YAML.

Invariants: every failure surfaces as a SourceError subclass (ApiError with the status, Gone for
410), aiohttp.ClientError or TimeoutError, never as a half-decoded object. A watch line without
its trailing newline is a stream cut mid-event and is an error, not an event. Each request has a
deadline (list) or a read timeout (watch), so a silent server cannot stall a reflector forever.

A list page (up to 500 EndpointSlices of 1,000 endpoints: ~6 MB, 0.14 s to decode) is read on the
loop and decoded in a worker thread one item at a time (`decode_list`): json's C decoder holds the
GIL for the whole of one call, so one call per page would stall the loop as long as decoding it on
the loop did; between items the thread hands the GIL back to the loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

import aiohttp

from usproxy.util.errors import SourceError
from usproxy.util.gc_pause import gc_paused, promote_survivors
from usproxy.sources.reflector import (ApiError, Gone, ItemReader, ListBody, ListResult, ReflectorOptions, WatchEvent,
                                      status_error)

SERVICES = "/api/v1/services"
ENDPOINT_SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
NODES = "/api/v1/nodes"
SERVICE_CIDRS = "/apis/networking.k8s.io/v1/servicecidrs"

Query = list[tuple[str, str]]


class ApiListWatch:
    """The ListWatch of one cluster-wide resource path (client-go cache.NewFilteredListWatchFromClient)."""

    def __init__(self, api: Any, path: str, *, label_selector: str = "", field_selector: str = "",
                 options: ReflectorOptions | None = None, read: ItemReader | None = None) -> None:
        self.api = api  # kubernetes_asyncio.client.ApiClient (untyped)
        self.path = path
        self.selectors: Query = [(k, v) for k, v in (("labelSelector", label_selector),
                                                     ("fieldSelector", field_selector)) if v]
        self.opts = options or ReflectorOptions()
        self.read = read  # each listed item goes through it as it is decoded (ListResult.items)

    async def list(self, resource_version: str) -> ListResult:
        """Every page of the list (client-go pager): the first at `resource_version`, then by token."""
        items: list[dict[str, Any]] = []
        query: Query = [("resourceVersion", resource_version)] if resource_version else []
        while True:
            body = await self._get_list(query + [("limit", str(self.opts.page_size))])
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return ListResult(items, _list_resource_version(dict(meta)))
            query = [("continue", token)]  # the token pins the resourceVersion of the first page

    async def watch(self, resource_version: str, timeout: float) -> AsyncGenerator[WatchEvent, None]:
        """Events after `resource_version` until the server ends the stream (after `timeout`)."""
        query: Query = [("watch", "true"), ("resourceVersion", resource_version),
                        ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(max(1, round(timeout))))]
        read = self.opts.read_timeout
        deadline = aiohttp.ClientTimeout(total=timeout + read, sock_connect=read, sock_read=read)
        async with await self._get(query, deadline) as resp:
            await raise_for_status(resp)
            while True:
                line = await _readline(resp)
                if not line:
                    return
                if not line.endswith(b"\n"):
                    raise SourceError("watch stream cut in the middle of an event")
                if line.strip():
                    yield decode_event(line)

    async def _get_list(self, query: Query) -> ListBody:
        timeout = aiohttp.ClientTimeout(total=self.opts.list_timeout, sock_read=self.opts.read_timeout)
        async with await self._get(query, timeout) as resp:
            await raise_for_status(resp)
            raw, content_type = await resp.read(), resp.content_type
        # The collector is paused while a page is decoded (~10 objects per endpoint: its passes
        # over them held the GIL 0.1-0.2 s each) and the page is promoted unscanned (gc_pause).
        with gc_paused(True):
            body = await asyncio.to_thread(decode_list, raw, content_type, self.read)
            promote_survivors()  # before the collector is back: its first pass would scan them all
        if not isinstance(body.get("items", []), list) or not str(body.get("kind", "List")).endswith("List"):
            raise SourceError(f"GET {self.path}: not a list (kind {body.get('kind')!r})")
        return cast(ListBody, body)

    async def _get(self, query: Query, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        resp = await self.api.call_api(
            self.path, "GET", query_params=query + self.selectors,
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
            response_types_map={}, _preload_content=False, _request_timeout=timeout)
        return cast(aiohttp.ClientResponse, resp)


async def _readline(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.content.readline()
    except ValueError as err:  # aiohttp: one line larger than its read buffer
        raise SourceError(f"watch event too large: {err}") from None


def _list_resource_version(meta: Mapping[str, Any]) -> str:
    rv = meta.get("resourceVersion")
    if not isinstance(rv, str) or not rv:
        raise SourceError("list without metadata.resourceVersion")
    return rv


async def raise_for_status(resp: aiohttp.ClientResponse) -> None:
    """Turn a non-2xx answer into Gone or ApiError, with the Status message or a page excerpt."""
    if 200 <= resp.status < 300:
        return
    raw = await resp.content.read(4096)
    try:
        status = decode_json(raw, resp.content_type)
    except SourceError:
        status = {}
    if status.get("kind") == "Status":
        err = status_error({"code": resp.status, **status})
        raise err
    if resp.status == 410:
        raise Gone(f"HTTP 410 {resp.reason}")
    raise ApiError(f"HTTP {resp.status} {resp.reason}: {excerpt(raw, resp.content_type)}", resp.status)


def decode_json(raw: bytes, content_type: str) -> dict[str, Any]:
    """A JSON object from a body, or a SourceError saying what came instead (an HTML page...)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise SourceError(f"expected JSON, got {content_type or 'no content type'}: {excerpt(raw, content_type)}") from None
    if not isinstance(body, dict):
        raise SourceError(f"expected a JSON object, got {type(body).__name__}")
    return body


_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def decode_list(raw: bytes, content_type: str, read: ItemReader | None = None) -> dict[str, Any]:
    """A list body as `decode_json` decodes it (the same object, the same SourceErrors), decoded
    one value of the top-level object at a time and the "items" array one item at a time, so a
    worker thread running it holds the GIL for at most one item (an object of at most ~1.5 MB,
    the API server's limit) at a stretch. With `read`, each item is replaced by what `read`
    makes of it as soon as it is decoded: the raw item is garbage before the next one is decoded,
    so a list never holds every raw object at once, and the memory they took is reused at once
    instead of being left in holes between the objects that stay."""
    try:
        text = raw.decode("utf-8")
        start = _skip(text, 0)
        if text[start:start + 1] != "{":
            return decode_json(raw, content_type)
        body, end = _object_by_items(text, start, read)
        if end != len(text):
            raise ValueError("extra data after the object")
    except ValueError:
        raise SourceError(f"expected JSON, got {content_type or 'no content type'}: {excerpt(raw, content_type)}") from None
    return body


def _skip(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i` (JSON whitespace)."""
    match = _SPACE.match(text, i)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _expect(text: str, i: int, chars: str) -> str:
    """The character at `i`, which must be one of `chars` (ValueError otherwise, end included)."""
    char = text[i:i + 1]
    if not char or char not in chars:
        raise ValueError(f"expected one of {chars!r} at {i}")
    return char


def _object_by_items(text: str, i: int, read: ItemReader | None) -> tuple[dict[str, Any], int]:
    """The object starting at text[i] ("{") and the index after it, whitespace after it skipped;
    an "items" array is decoded item by item."""
    out: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if text[i:i + 1] == "}":
        return out, _skip(text, i + 1)
    while True:
        _expect(text, i, '"')
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        _expect(text, i, ":")
        i = _skip(text, i + 1)
        if key == "items" and text[i:i + 1] == "[":
            out[key], i = _array_by_items(text, i, read)
        else:
            out[key], i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if _expect(text, i, ",}") == "}":
            return out, _skip(text, i + 1)
        i = _skip(text, i + 1)


def _array_by_items(text: str, i: int, read: ItemReader | None) -> tuple[list[Any], int]:
    """The array starting at text[i] ("[") and the index after it, one raw_decode per item."""
    items: list[Any] = []
    i = _skip(text, i + 1)
    if text[i:i + 1] == "]":
        return items, i + 1
    while True:
        item, i = _DECODER.raw_decode(text, i)
        items.append(item if read is None else _made(read, item))
        i = _skip(text, i)
        if _expect(text, i, ",]") == "]":
            return items, i + 1
        i = _skip(text, i + 1)


def _made(read: ItemReader, item: dict[str, Any]) -> object:
    """`read(item)`; a ValueError of its own is not the body's (decode_list takes a ValueError
    for JSON that does not decode), so it leaves as a RuntimeError naming where it came from."""
    try:
        return read(item)
    except ValueError as err:
        raise RuntimeError(f"reading a listed item: {err!r}") from err


def decode_event(line: bytes) -> WatchEvent:
    """One watch line as a WatchEvent; a SourceError for anything else."""
    body = decode_json(line, "watch stream")
    kind, obj = body.get("type"), body.get("object")
    if not isinstance(kind, str) or not isinstance(obj, dict):
        raise SourceError(f"malformed watch event: {excerpt(line, 'application/json')}")
    return WatchEvent(type=kind, object=obj)


_TAG = re.compile(rb"<[^>]*>")


def excerpt(raw: bytes, content_type: str, limit: int = 120) -> str:
    """The start of a body for a log line; markup stripped from HTML error pages."""
    if "html" in content_type or raw.lstrip()[:1] == b"<":
        raw = _TAG.sub(b" ", raw)
    text = " ".join(raw.decode("utf-8", "replace").split())
    return (text[:limit] + "...") if len(text) > limit else text or "<empty body>"
