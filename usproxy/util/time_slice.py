"""TimeSlice: give the event loop a turn after every few milliseconds of work.

A long run of work on the loop (applying a relist of 100,000 endpoints: ~2 s in one piece)
stalls every relayed connection for as long as it runs. Work that calls `await pause()` between
its items gives the loop a turn (asyncio.sleep(0)) once `budget` seconds have passed since the
last turn, so no stretch of it blocks the loop for longer than the budget plus one item.
The measure is time, not a count of items, because items differ in cost by orders of magnitude
(a Service, a slice of 1,000 endpoints).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

BUDGET = 0.005  # seconds of work between two turns of the loop


class TimeSlice:
    """Counts work time since the loop's last turn; `clock` gives seconds (monotonic)."""

    __slots__ = ("budget", "clock", "_since")

    def __init__(self, budget: float = BUDGET, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = budget
        self.clock = clock
        self._since = clock()

    async def pause(self) -> None:
        """Give the loop a turn if `budget` seconds of work ran since the last one."""
        if self.clock() - self._since >= self.budget:
            await asyncio.sleep(0)
            self._since = self.clock()
