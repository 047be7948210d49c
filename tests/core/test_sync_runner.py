"""SyncRunner with a fake clock: bursts, the min interval, the periodic max interval, and retry
after a failed sync (the loop never ends because a sync raised)."""

from __future__ import annotations

import asyncio

from usproxy.core.sync_runner import FakeClock, SyncRunner


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
