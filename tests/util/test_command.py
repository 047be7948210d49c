"""util/command.py on both event loops: a command's exit code and stderr, its stdout, 127 for a
program that is not installed, input on stdin, and a command whose caller is cancelled is killed
and reaped (no process left behind)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from usproxy.util.command import output, run


@pytest.fixture(params=["asyncio", "uvloop"])
def go(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return uvloop.run if request.param == "uvloop" else asyncio.run


def test_exit_code_and_stderr(go: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    code, err = go(run([sys.executable, "-c", "import sys; print('out'); sys.exit('bad thing')"]))
    assert (code, err) == (1, "bad thing")


def test_stdin_reaches_the_command(go: Callable[[Coroutine[Any, Any, Any]], Any], tmp_path: Path) -> None:
    dest = tmp_path / "copy"
    code, err = go(run([sys.executable, "-c", f"import sys; open({str(dest)!r}, 'w').write(sys.stdin.read())"],
                       "table ip t {}\n"))
    assert (code, err) == (0, "")
    assert dest.read_text() == "table ip t {}\n"


def test_output_is_stdout_only(go: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    text = go(output([sys.executable, "-c", "import sys; print('rules'); print('noise', file=sys.stderr)"]))
    assert text == "rules\n"


def test_a_missing_program(go: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    code, err = go(run(["usproxy-no-such-program"]))
    assert code == 127 and "No such file" in err
    assert go(output(["usproxy-no-such-program"])) == ""


def test_a_cancelled_command_is_killed_and_reaped(go: Callable[[Coroutine[Any, Any, Any]], Any],
                                                  tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

    async def cancel_it() -> int:
        task = asyncio.ensure_future(run([sys.executable, "-c", script]))
        for _ in range(500):
            if pidfile.exists() and pidfile.read_text():
                break
            await asyncio.sleep(0.01)
        pid = int(pidfile.read_text())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    pid = go(cancel_it())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no zombie keeps the pid
        os.kill(pid, 0)


def test_a_command_cancelled_at_once_leaves_no_pipe_open(go: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    """Cancelled while its communicate() still waits for a worker thread (the loop's executor
    busy): killed, reaped, its pipes closed, not left to the garbage collector (a
    ResourceWarning in a CI run)."""
    import gc
    import threading

    unraisable: list[str] = []

    async def cancel_at_once() -> None:
        loop = asyncio.get_running_loop()
        busy = threading.Event()
        blockers = [loop.run_in_executor(None, busy.wait) for _ in range(64)]  # every worker thread taken
        tasks = [asyncio.ensure_future(f([sys.executable, "-c", "import time; time.sleep(60)"]))
                 for f in (run, output)]
        await asyncio.sleep(0.1)  # both started their commands; communicate() waits for a thread
        for task in tasks:
            task.cancel()
        busy.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*blockers)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)

    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(repr(u.exc_value))
    try:
        go(cancel_at_once())
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []
