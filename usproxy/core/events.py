"""EventHub: a small in-process publish/subscribe of what happens on the node, for the web view.

Publishers (the offload manager when a ServicePort is offloaded or demoted, the web view's
snapshot task) call `publish()`, which never blocks and never awaits: it runs on the event loop
in the middle of a sync. Each subscriber (one per open browser page) has its own bounded queue:
at most `Subscription.LIMIT` events wait for a subscriber; beyond that the oldest are dropped and
counted in `dropped`, so a slow or stalled browser can neither block the loop nor grow memory
without bound. Snapshots ("the state now") are not queued at all: a subscriber keeps only the
latest one, since an older snapshot is worth nothing once a newer exists. The hub also keeps the
last RECENT events, so a page opened later shows what happened before it.

A publisher with a big payload (the web view's snapshot of 5,000 Services) encodes it itself, off
the loop, and publishes the text (`publish_encoded`): the hub never encodes anything.

Invariant: used from the event loop's thread only (no locks).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


_EMPTY_OBJECT = re.compile(rb"\{\s*\}\s*\Z")


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened: `kind` ("offloaded", "demoted", "userspace", "snapshot"),
    `at` (Unix seconds), `seq` (increasing per hub), `data` (JSON-ready), or instead of `data`
    `encoded`: the UTF-8 JSON text of an object its publisher encoded already, "{" first."""

    kind: str
    at: float
    seq: int
    data: dict[str, Any]
    encoded: bytes | None = None

    def json(self) -> dict[str, Any]:
        data = self.data if self.encoded is None else json.loads(self.encoded)
        return {"kind": self.kind, "at": self.at, "seq": self.seq, **data}

    def json_parts(self) -> list[bytes | memoryview]:
        """The UTF-8 of `json.dumps(self.json())` in pieces to join: `encoded` is spliced in as it
        is, never decoded, re-encoded or copied (a snapshot of 5,000 Services is ~3 MB)."""
        if self.encoded is None:
            return [json.dumps(self.json()).encode()]
        head = json.dumps({"kind": self.kind, "at": self.at, "seq": self.seq}).encode()
        if _EMPTY_OBJECT.match(self.encoded):
            return [head]
        return [head[:-1], b", ", memoryview(self.encoded)[1:]]  # its members after our own


class Subscription:
    """One subscriber's view of the hub: queued events and the latest snapshot."""

    LIMIT = 256  # events queued for one subscriber before the oldest are dropped

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.events: deque[Event] = deque(maxlen=self.LIMIT)
        self.snapshot: Event | None = None
        self.dropped = 0
        self._ready = asyncio.Event()

    def offer(self, ev: Event) -> None:
        """Queue `ev` without blocking (a snapshot replaces the previous one)."""
        if ev.kind == "snapshot":
            self.snapshot = ev
        else:
            if len(self.events) == self.LIMIT:
                self.dropped += 1
            self.events.append(ev)
        self._ready.set()

    async def next(self, timeout: float | None = None) -> list[Event]:
        """Everything pending (events in order, then the latest snapshot); [] after `timeout`
        seconds with nothing pending."""
        if not self.events and self.snapshot is None:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return []
        out = list(self.events)
        self.events.clear()
        if self.snapshot is not None:
            out.append(self.snapshot)
            self.snapshot = None
        return out

    def close(self) -> None:
        self.hub.unsubscribe(self)


class EventHub:
    """Fan-out of events to subscriptions; see the module docstring for the bounds."""

    RECENT = 50  # events replayed to a new subscriber

    def __init__(self, clock: Any = time.time) -> None:
        self.subscribers: set[Subscription] = set()
        self.recent: deque[Event] = deque(maxlen=self.RECENT)
        self._seq = itertools.count(1)
        self._clock = clock

    def publish(self, kind: str, **data: Any) -> Event:
        """Deliver an event to every subscriber now; never blocks. Returns the event."""
        return self._deliver(Event(kind, self._clock(), next(self._seq), data))

    def publish_encoded(self, kind: str, encoded: bytes) -> Event:
        """`publish` with the event's data given as the JSON text of an object (`Event.encoded`)."""
        return self._deliver(Event(kind, self._clock(), next(self._seq), {}, encoded))

    def _deliver(self, ev: Event) -> Event:
        kind = ev.kind
        if kind != "snapshot":
            self.recent.append(ev)
        for sub in self.subscribers:
            sub.offer(ev)
        return ev

    def subscribe(self) -> Subscription:
        """A new subscription, primed with the recent events."""
        sub = Subscription(self)
        for ev in self.recent:
            sub.offer(ev)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)
