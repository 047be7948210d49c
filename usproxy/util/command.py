"""Command: a program (nft, iptables-save, ...) run to its end from the event loop.

The child is started with subprocess.Popen, which forks with vfork (about 0.7 ms), and waited for
in a worker thread. The event loop's own subprocess support is not used: uvloop's (libuv's) spawn
forks the whole agent, copying its page tables on the loop's thread: 7 ms per command in a
process of 150 MiB with uvloop 0.23 on Python 3.11 here, against 0.2-0.8 ms of the loop's time
this way (a start of 10,000 Services runs 6 to 8 commands). A command still running when its
caller is cancelled (the agent stops) is killed and reaped, its pipes closed, before the
cancellation goes on.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Sequence


async def _finish(proc: subprocess.Popen[bytes], stdin: bytes | None) -> tuple[bytes, bytes]:
    """proc.communicate in a worker thread; killed and reaped when the caller is cancelled."""
    try:
        out, err = await asyncio.to_thread(proc.communicate, stdin)
    except asyncio.CancelledError:
        proc.kill()
        await asyncio.to_thread(_reap, proc)
        raise
    return out or b"", err or b""


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a killed command and close its pipes: a cancellation that came before the worker
    thread ran communicate() leaves them open (a close waits here for a read still running)."""
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


async def run(argv: Sequence[str], stdin: str = "") -> tuple[int, str]:
    """(exit code, stderr) of a command; 127 when it is not installed."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return 127, exc.strerror or str(exc)
    _, err = await _finish(proc, stdin.encode() if stdin else None)
    return proc.returncode or 0, err.decode(errors="replace").strip()


async def output(argv: Sequence[str]) -> str:
    """What a command writes to stdout ("" when it cannot run); killed when cancelled."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return ""
    out, _ = await _finish(proc, None)
    return out.decode(errors="replace")
