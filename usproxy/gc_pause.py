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

Pauses may overlap (a relist's pause spans awaits, a sync may run meanwhile): the collector is
re-enabled when the last open pause closes, and only if it was enabled when the first opened.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

LARGE = 1000  # changes in one sync from which pausing pays off

_open = 0  # pauses open now
_was_enabled = False  # whether the collector was on when the first of them opened


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
    unfreeze: both only splice lists). Nothing stays frozen: full collections still see them."""
    gc.freeze()
    gc.unfreeze()
