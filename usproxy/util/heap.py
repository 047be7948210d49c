"""The process heap: freed flow buffers go back to the system once many flows have ended.

Why: glibc keeps what Python frees in its heap (its mmap threshold rises to the largest buffer
freed, so the relay's 256 KiB read buffers come from the heap, not from mmap), and a heap
fragmented by thousands of stuck flows' buffers stayed mapped after they closed (issue 18: RSS
53 MiB -> 2.2 GiB with 2,000 clients that never read, kept after they left). `malloc_trim(0)`
returns every free page of every arena (glibc >= 2.8 also releases free pages inside the heap,
not only its top).

`give_back_free_heap()` does the same once, after a large sync (Proxier.sync).

Invariants: never on the hot path (the relay's once-a-second sweep awaits `tick`, and the trim runs
in a worker thread); at most once per
MIN_INTERVAL seconds; only after the live flow count fell by DROP flows from its peak since the
last trim (a steady load reuses its memory and is never trimmed); a no-op where the C library is
not glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
MIN_INTERVAL = 5.0  # seconds between trims
DROP = 64  # live flows fewer than their peak since the last trim before a trim is worth it


def glibc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` as a callable returning 1 when memory was released; None when the
    C library is not glibc (musl has no malloc_trim; its allocator returns memory itself)."""
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter runs on (find_library forks ldconfig)
        libc.gnu_get_libc_version  # glibc only
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


class HeapTrim:
    """Trims the heap after the flow count fell; `tick(live)` once a second with the live flows."""

    def __init__(self, trim: Callable[[], int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.trim = trim
        self.clock = clock
        self.peak = 0
        self.last = float("-inf")
        self.trims = 0

    @classmethod
    def for_glibc(cls) -> HeapTrim:
        return cls(glibc_trim())

    async def tick(self, live: int) -> bool:
        """Note `live` flows; trim when they fell by DROP from the peak and MIN_INTERVAL passed.
        The trim runs in a worker thread (ctypes lets go of the GIL), so the loop goes on unless it
        needs the C allocator meanwhile (then it waits for that arena's trim: 370 MiB given back
        took 28 ms here). Returns whether it trimmed."""
        self.peak = max(self.peak, live)
        now = self.clock()
        if self.trim is None or self.peak - live < DROP or now - self.last < MIN_INTERVAL:
            return False
        self.last, self.peak = now, live
        t0 = time.perf_counter()
        await asyncio.to_thread(self.trim)
        self.trims += 1
        log.debug("heap trimmed in %.1f ms after flows fell to %d", (time.perf_counter() - t0) * 1000, live)
        return True


_TRIM = glibc_trim()


async def give_back_free_heap() -> None:
    """Return the free pages of the C heap to the system (in a worker thread) after a burst that
    freed most of what it allocated: a cold sync of 10,000 Services left ~65 MiB of libnftables'
    transaction and the manifest's parse free but mapped. A no-op where the C library is not glibc."""
    if _TRIM is not None:
        await asyncio.to_thread(_TRIM)
