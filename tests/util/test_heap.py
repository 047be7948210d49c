"""HeapTrim (usproxy/util/heap.py): when the relay gives freed flow buffers back to the system.

The effect on a real agent (RSS back to its size before 300 stuck flows closed) is asserted in
tests/relay/test_memory_bounds.py; here, the rule: only after the flow count fell by DROP from its
peak, at most every MIN_INTERVAL seconds, never where there is no glibc.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from usproxy.util.heap import DROP, MIN_INTERVAL, HeapTrim, glibc_trim


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def recording(calls: list[int]) -> Callable[[], int]:
    """A trim function that records each call (and reports 1: memory was released)."""
    def trim() -> int:
        calls.append(1)
        return 1
    return trim


def run(heap: HeapTrim, live: int) -> bool:
    return asyncio.run(heap.tick(live))


def test_trims_after_the_flow_count_fell_and_not_more_often_than_the_interval() -> None:
    calls: list[int] = []
    clock = Clock()
    heap = HeapTrim(recording(calls), clock)
    assert not run(heap, 500)
    assert not run(heap, 500 - DROP + 1)  # fell, but by less than DROP
    assert run(heap, 500 - DROP) and calls == [1]
    assert not run(heap, 1000) and not run(heap, 0)  # fell again within MIN_INTERVAL
    clock.now += MIN_INTERVAL
    assert run(heap, 0) and calls == [1, 1] and heap.trims == 2


def test_a_steady_load_is_never_trimmed() -> None:
    calls: list[int] = []
    clock = Clock()
    heap = HeapTrim(recording(calls), clock)
    for i in range(100):
        clock.now += 1.0
        run(heap, 1000 + (i % 2) * (DROP - 1))
    assert calls == []


def test_without_glibc_nothing_is_called() -> None:
    heap = HeapTrim(None, Clock())
    assert not run(heap, 1000) and not run(heap, 0) and heap.trims == 0


def test_glibc_trim_is_found_here() -> None:
    """This project's machines run glibc (Debian): the trim must be found, and callable."""
    trim = glibc_trim()
    assert trim is not None and trim() in (0, 1)
