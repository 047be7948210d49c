"""gc_paused: the cyclic garbage collector off while a large sync or relist builds its objects.

A cold sync of 10,000 Services allocates a few hundred thousand small objects (endpoints, states,
nftables elements), none of them cyclic garbage; the collector's generation-2 passes over that
heap cost a fifth of the sync. A relist of 100,000 endpoints grows the heap enough to trigger
several generation-2 passes of 0.1-0.2 s each, every one of them a stall of the loop (in a worker
thread too: the collector holds the GIL). Reference counting still frees everything; the
collector runs again afterwards (as CPython's own advice for allocation bursts, and what
gc.freeze() is for at start-up).

Objects allocated during a pause are all young: the first collections after it would scan them
all (a relist's survivors: ~0.03-0.1 s, again a stall), so a relist ends its pause with
`promote_survivors()`, which moves every tracked object to the oldest generation without a scan.
They are scanned again only by the next full collection, which comes as the heap grows, as always.

After a large sync the whole heap is frozen (`freeze_heap`): the Services, endpoints and rules it
built live as long as the agent, and a full collection walked them all with the GIL held (5,000
Services of 8 endpoints and 10,000 flows: ~220,000 objects, 40-125 ms on a loaded 2-core node, a
stall of the relay however the work around it is sliced). CPython's gc.freeze() moves every
tracked object into a permanent generation no collection visits; reference counting still frees
them (almost all of the agent's state is acyclic: frozen dataclasses, tuples, dicts). The price,
stated: an object alive at a freeze that later dies inside a reference cycle is not reclaimed
until the frozen heap is given back (the relay breaks its own flows' cycles, and under uvloop a
closed connection leaves none; under the asyncio loop each connection open at a freeze left ~12
objects of cyclic garbage when it closed). So freezes come only after large syncs (at start,
after a relist or a large change), never per request, and a freeze at least RECLAIM_INTERVAL
after the last reclaim first unfreezes and runs one full collection (one stall per hour at most,
where without freezing every full collection was one).

Pauses may overlap (a relist's pause spans awaits, a sync may run meanwhile): the collector is
re-enabled when the last open pause closes, and only if it was enabled when the first opened.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

LARGE = 1000  # changes in one sync from which pausing pays off
RECLAIM_INTERVAL = 3600.0  # seconds from a reclaim of the frozen heap before a freeze does the next

_open = 0  # pauses open now
_was_enabled = False  # whether the collector was on when the first of them opened
_last_reclaim: float | None = None  # monotonic time of the first freeze or the last reclaim


@contextlib.contextmanager
def gc_paused(pause: bool) -> Iterator[None]:
    """Disable the collector inside the block when `pause`; nested and overlapping blocks are safe."""
    global _open, _was_enabled
    if not pause:
        yield
        return
    if _open == 0:
        _was_enabled = gc.isenabled()
        gc.disable()
    _open += 1
    try:
        yield
    finally:
        _open -= 1
        if _open == 0 and _was_enabled:
            gc.enable()


def promote_survivors() -> None:
    """Move every object the collector tracks into its oldest generation, unscanned (freeze, then
    unfreeze: both only splice lists), so full collections still see them. Once a heap is frozen
    (`freeze_heap`), they join it instead: gc.unfreeze() thaws the whole permanent generation, and
    did, at every static reload (a parse promotes its survivors), so the next full collections
    walked the agent's whole state again (10,000 Services: ~550,000 objects, 0.25-0.45 s of CPU
    with the GIL held, in one change in ten). They are thawed at the next reclaim (freeze_heap)."""
    gc.freeze()
    if _last_reclaim is None:  # no freeze_heap yet (gc.get_freeze_count() walks the whole list)
        gc.unfreeze()


def freeze_heap(clock: Callable[[], float] = time.monotonic) -> None:
    """Move every object the collector tracks into the permanent generation (gc.freeze): later
    collections, full ones included, never walk them again. When RECLAIM_INTERVAL passed since
    the last reclaim, the frozen heap is first given back and collected once (see the module
    docstring)."""
    global _last_reclaim
    now = clock()
    if _last_reclaim is None:
        _last_reclaim = now
    elif now - _last_reclaim >= RECLAIM_INTERVAL:
        gc.unfreeze()
        gc.collect()
        _last_reclaim = now
    gc.freeze()
