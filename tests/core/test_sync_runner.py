"""SyncRunner with a fake clock: bursts, the min interval, the periodic max interval, and retry
after a failed sync (the loop never ends because a sync raised), logged once per failure and then
once a minute, and said (last_error) until a sync succeeds."""

from __future__ import annotations

import asyncio
import logging

import pytest

from usproxy.core.sync_runner import REPEAT_LOG, FakeClock, SyncRunner


async def started(min_interval: float = 1.0, max_interval: float = 30.0, fail: int = 0,
                  burst: int = 2) -> tuple[SyncRunner, FakeClock, list[float], asyncio.Task[None]]:
    clock = FakeClock()
    runs: list[float] = []
    failures = [fail]

    async def fn() -> None:
        runs.append(clock.monotonic())
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("boom")

    runner = SyncRunner(fn, min_interval=min_interval, max_interval=max_interval, burst_runs=burst,
                        clock=clock)
    task = asyncio.create_task(runner.loop())
    await clock.advance(0)  # let the loop reach its first wait
    return runner, clock, runs, task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_burst_then_min_interval() -> None:
    runner, clock, runs, task = await started()
    for _ in range(5):
        runner.run()
        await clock.advance(0)
    assert len(runs) == 2  # the burst
    await clock.advance(0.5)
    assert len(runs) == 2  # not before min_interval
    await clock.advance(0.6)
    assert len(runs) == 3 and runs[-1] == 1001.0
    await stop(task)


async def test_requests_coalesce_into_one_sync() -> None:
    runner, clock, runs, task = await started(burst=1)
    runner.run()
    await clock.advance(0)
    for _ in range(10):
        runner.run()
    await clock.advance(1.0)
    await clock.advance(5.0)
    assert len(runs) == 2
    await stop(task)


async def test_periodic_sync_without_requests() -> None:
    _, clock, runs, task = await started(max_interval=30.0)
    await clock.advance(29.0)
    assert runs == []
    await clock.advance(1.5)
    assert runs == [1030.0]
    await stop(task)


async def test_failed_sync_is_retried_and_loop_survives() -> None:
    runner, clock, runs, task = await started(fail=2)
    runner.run()
    await clock.advance(0)
    assert len(runs) == 1 and runner.failures == 1
    await clock.advance(1.0)
    assert len(runs) == 2 and runner.failures == 2
    await clock.advance(1.0)
    assert len(runs) == 3 and runner.runs == 1 and not task.done()
    await stop(task)


async def test_no_sync_starts_while_held_and_requests_are_kept() -> None:
    runner, clock, runs, task = await started()
    with runner.hold():
        with runner.hold():  # holds nest (two sources relisting at once)
            runner.run()
            await clock.advance(40.0)  # past the periodic max interval as well
        runner.run()
        await clock.advance(1.0)
        assert runs == []
    await clock.advance(0)
    assert len(runs) == 1  # what was asked for while held runs once the last hold closes
    await stop(task)


async def test_a_recurring_failure_is_logged_once_a_minute_and_said_until_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sync failing the same way every second (a node refusing netlink) logs its traceback
    once, then one line per REPEAT_LOG seconds; last_error and failing_since say what fails
    until a sync succeeds."""
    caplog.set_level(logging.INFO, "usproxy.core.sync_runner")
    runner, clock, runs, task = await started(fail=1000)
    runner.run()
    await clock.advance(0)
    assert runner.last_error == "RuntimeError: boom" and runner.failing_since is not None
    for _ in range(int(2 * REPEAT_LOG) + 5):
        await clock.advance(1.0)
    assert len(runs) > 2 * REPEAT_LOG
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, [r.getMessage() for r in errors]  # the first, and one a minute
    assert errors[0].exc_info is not None and all(r.exc_info is None for r in errors[1:])
    assert "sync still failing" in errors[1].getMessage() and "RuntimeError: boom" in errors[1].getMessage()
    await stop(task)


async def test_success_clears_the_failure() -> None:
    runner, clock, runs, task = await started(fail=2)
    runner.run()
    await clock.advance(0)
    assert runner.last_error is not None
    await clock.advance(2.5)
    assert len(runs) == 3 and runner.last_error is None and runner.failing_since is None
    await stop(task)
