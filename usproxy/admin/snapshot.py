"""Admin snapshots: a view of the agent (/services, /flows, the web view's stream) taken on the loop
and encoded as JSON in a worker thread, one build at a time however many clients ask.

Why: with 5,000 Services a /services poll stalled relayed connections ~0.5 s, and /flows with
10,000 flows 0.15-0.3 s, encoding included. The rows are built on the loop (the agent's state
lives there and is never read from a thread) in chunks with the loop running between them
(Agent.services, Agent.flows); what a thread receives is only those rows: fresh dicts, lists,
strings and numbers that nothing else holds or changes.

Encoding never holds the GIL for a whole view: json's C encoder holds it for the whole of one
call, so one C call for a whole view would stall the loop from the thread as much as on it.
Compact JSON goes a row at a time through the C encoder (`rows_json`); indented JSON goes through
the encoder's incremental Python path (`rows_json_pretty`). Nor does any copy of a whole body: a
body stays in parts (~100 KB) from encoder to socket (`write_chunked`), since one 9 MB join or
`+ b"\\n"` is ~5 ms of copying and page faults with the GIL held.

`SharedBuild` bounds the cost of many clients: at most one build of a view runs at a time, and a
request that arrives while one runs gets the next build (started after it arrived, so never a
view older than the request), which every request waiting meanwhile shares.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from aiohttp import web

from usproxy.util.gc_pause import gc_paused

T = TypeVar("T")
Row = TypeVar("Row", bound=Mapping[str, object])  # a row of /services or /flows (usproxy/util/rows.py)
Rows = Sequence[Mapping[str, object]]
JOIN = 4096  # encoded pieces joined in one call (~0.1 ms)
WRITE_CHUNK = 1 << 18  # bytes of a big answer written at a time
FREE = 256  # rows freed in one statement (~0.5 ms)


def rows_json(rows: Rows) -> str:
    """`json.dumps(list(rows))` (compact: the web view's stream), one json.dumps call per row."""
    return "[" + ", ".join(json.dumps(row) for row in rows) + "]"


def rows_json_pretty(rows: Rows) -> list[bytes]:
    """`json.dumps(list(rows), indent=1)` as UTF-8 in parts (their concatenation is the text; what
    /services and /flows answer), encoded by the JSONEncoder's incremental path (`iterencode`, the
    documented way to stream a big object: Python code between values, where a thread hands the
    GIL back), its pieces joined JOIN at a time (one join of a million pieces holds the GIL ~20 ms).
    The parts are never joined: one 9 MB bytes object costs ~6 ms of copying and page faults with
    the GIL held, and a `+ b"\\n"` as much again. One encoder for the whole view: each indented
    json.dumps call leaves a cycle of closures behind for the collector."""
    parts: list[bytes] = []
    pieces: list[str] = []
    for piece in json.JSONEncoder(indent=1).iterencode(list(rows)):
        pieces.append(piece)
        if len(pieces) >= JOIN:
            parts.append("".join(pieces).encode())
            pieces.clear()
    parts.append("".join(pieces).encode())
    return parts


def free(rows: list[Any]) -> None:
    """Empty `rows`, FREE at a time: freeing 5,000 Services' rows in one statement (a cascade of
    deallocations in C) holds the GIL ~20 ms; in pieces, a thread doing it hands the GIL back."""
    while rows:
        del rows[-FREE:]


def encode_and_free(rows: list[Row]) -> list[bytes]:
    """`rows_json_pretty(rows)` and a final newline, in parts; `rows` is emptied (see `free`)."""
    body = rows_json_pretty(rows)
    body.append(b"\n")
    free(rows)
    return body


async def encoded_rows(rows_of: Callable[[], Awaitable[list[Row]]]) -> list[bytes]:
    """The body of /services or /flows: the rows `rows_of()` builds on the loop (a list nothing
    else holds), encoded (pretty, with a final newline) and freed in a worker thread, which owns
    the list from then on. The cyclic collector is paused meanwhile: the rows (~20 tracked objects
    per Service) survive long enough to set off full collections, each a pass over the whole heap
    with the GIL held (60-70 ms with 5,000 Services); they are freed by reference counting before
    the pause ends, so nothing is promoted (gc_pause)."""
    with gc_paused(True):
        return await asyncio.to_thread(encode_and_free, await rows_of())


async def write_chunked(resp: web.StreamResponse, body: bytes | Sequence[bytes | memoryview]) -> None:
    """Write `body` (bytes, or parts to send one after another) to a prepared `resp` at most
    WRITE_CHUNK bytes at a time: one write of a 15 MB view copies it whole on the loop (~10 ms);
    a write that fills the socket's buffer waits for it to drain. Slices are memoryviews: nothing
    is copied before the transport takes it."""
    for part in [body] if isinstance(body, bytes) else body:
        view = memoryview(part)
        for at in range(0, view.nbytes, WRITE_CHUNK):
            await resp.write(view[at:at + WRITE_CHUNK])


class SharedBuild(Generic[T]):
    """Runs `build` for its callers, one run at a time; callers that arrive during a run share the
    next run (see the module docstring). A run that fails fails only the callers that waited for
    it; the next caller runs it again. A result is kept only while some caller waits for it (a
    view of 5,000 Services is ~10 MB)."""

    def __init__(self, build: Callable[[], Awaitable[T]]) -> None:
        self._build = build
        self._lock = asyncio.Lock()
        self._started = 0  # runs started so far
        self._done: tuple[int, T] | None = None  # the last successful run: its number, its result
        self._callers = 0  # callers in get() now
        self.runs = 0  # successful runs (tests count them)

    async def get(self) -> T:
        """A result of a run that started after this call did."""
        arrived = self._started
        self._callers += 1
        try:
            async with self._lock:
                if self._done is not None and self._done[0] > arrived:
                    return self._done[1]
                self._started += 1
                number = self._started
                result = await self._build()
                self._done = (number, result)
                self.runs += 1
                return result
        finally:
            self._callers -= 1
            if not self._callers:
                self._done = None
