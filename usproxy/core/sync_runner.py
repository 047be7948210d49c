"""SyncRunner: an asyncio port of kube-proxy's BoundedFrequencyRunner (pkg/util/async).

`run()` asks for a sync; syncs happen at most `burst_runs` in a row and then no more often than
once per `min_interval` seconds (a token bucket), and at least once per `max_interval` seconds.
A sync that raises is logged and retried after `retry_interval`; the loop never ends because of
it. A failure is logged with its traceback the first time it happens; the same failure again (type
and message) is one line at most once per REPEAT_LOG seconds, with how often it recurred, so a
node that refuses every sync (no CAP_NET_ADMIN, a kernel that lost a module) does not flood the
log. `last_error` and `failing_since` say what fails now (None once a sync succeeds), for /healthz. While a `hold()` is open no sync starts (one already running finishes): a source applying a
relist in chunks, with the loop running between them, is never synced half-applied.
Time comes from an injectable Clock, so tests drive it without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

log = logging.getLogger(__name__)
REPEAT_LOG = 60.0  # seconds between log lines of one recurring sync failure


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that only moves when `advance()` is called; sleepers wake as their time passes."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + max(0.0, seconds), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking sleepers in order and letting them run."""
        target = self.now + seconds
        while True:
            due = sorted((t, f) for t, f in self._sleepers if t <= target and not f.done())
            if not due:
                break
            self.now = max(self.now, due[0][0])
            due[0][1].set_result(None)
            self._sleepers = [(t, f) for t, f in self._sleepers if not f.done()]
            await _settle()
        self.now = target
        await _settle()


async def _settle(rounds: int = 20) -> None:
    """Let woken tasks run (a FakeClock helper)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class SyncRunner:
    """Runs `fn` on request, bounded in frequency, at least every `max_interval` seconds."""

    def __init__(
        self,
        fn: Callable[[], Awaitable[None]],
        *,
        min_interval: float = 1.0,
        max_interval: float = 30.0,
        burst_runs: int = 2,
        retry_interval: float | None = None,
        clock: Clock | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self.fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.burst_runs = max(1, burst_runs)
        self.retry_interval = retry_interval if retry_interval is not None else max(min_interval, 1.0)
        self.clock: Clock = clock or RealClock()
        self._on_queued = on_queued
        self._kick = asyncio.Event()  # re-evaluate: a request arrived or the schedule moved
        self._requested = False
        self._tokens = float(self.burst_runs)
        self._last_refill = self.clock.monotonic()
        self._next_run = self.clock.monotonic() + max_interval
        self.runs = 0
        self.failures = 0
        self.last_error: str | None = None  # the failure of the last sync, None when it succeeded
        self.failing_since: float | None = None  # wall time of the first failure in a row
        self._repeats = 0  # failures like last_error not logged yet
        self._logged_at = 0.0  # monotonic time last_error was last logged
        self._holds = 0
        self._released = asyncio.Event()
        self._released.set()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """No sync starts until every hold is closed; requests meanwhile are kept, not lost."""
        self._holds += 1
        self._released.clear()
        try:
            yield
        finally:
            self._holds -= 1
            if not self._holds:
                self._released.set()

    def run(self) -> None:
        """Ask for a sync as soon as the frequency bound allows."""
        if self._on_queued is not None:
            self._on_queued()
        self._requested = True
        self._kick.set()

    def retry_after(self, seconds: float) -> None:
        """Run again within `seconds` even if nothing asks for it."""
        self._next_run = min(self._next_run, self.clock.monotonic() + seconds)
        self._kick.set()

    def _take_token_delay(self) -> float:
        now = self.clock.monotonic()
        rate = 1.0 / self.min_interval if self.min_interval > 0 else float("inf")
        self._tokens = min(float(self.burst_runs), self._tokens + (now - self._last_refill) * rate)
        self._last_refill = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / rate

    async def _wait(self) -> None:
        """Until a sync was requested or the next scheduled run is due."""
        while not self._requested:
            timeout = self._next_run - self.clock.monotonic()
            if timeout <= 0:
                return
            self._kick.clear()
            waiter = asyncio.ensure_future(self._kick.wait())
            sleeper = asyncio.ensure_future(self.clock.sleep(timeout))
            try:
                await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (waiter, sleeper):
                    t.cancel()

    async def loop(self) -> None:
        """Run forever (until cancelled)."""
        while True:
            await self._wait()
            delay = self._take_token_delay()
            while delay > 0:
                await self.clock.sleep(delay)
                delay = self._take_token_delay()
            while self._holds:
                await self._released.wait()
            self._requested = False
            await self._run_once()

    async def _run_once(self) -> None:
        self._next_run = self.clock.monotonic() + self.max_interval
        try:
            await self.fn()
            self.runs += 1
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.failures += 1
            self._failed(err)
            self.retry_after(self.retry_interval)
        else:
            if self.last_error is not None:
                log.info("sync succeeded after %d failures", self._repeats + 1)
            self.last_error = self.failing_since = None
            self._repeats = 0

    def _failed(self, err: Exception) -> None:
        """Log a failed sync: a new failure with its traceback, a recurring one as one line now and
        then."""
        text = f"{type(err).__name__}: {err}"
        now = self.clock.monotonic()
        if self.failing_since is None:
            self.failing_since = time.time()
        if text != self.last_error:
            self.last_error, self._repeats, self._logged_at = text, 0, now
            log.error("sync failed; retrying every %.1fs", self.retry_interval, exc_info=err)
            return
        self._repeats += 1
        if now - self._logged_at >= REPEAT_LOG:
            log.error("sync still failing (%d more times): %s", self._repeats, text)
            self._logged_at, self._repeats = now, 0
