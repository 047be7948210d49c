"""NetnsWorker: one dedicated thread for blocking kernel calls, in a network namespace when given.

libnftables blocks, and pyroute2's synchronous API cannot run inside a running event loop, so the
nftables client and kernel conntrack each run their calls in a thread of their own, never on the
agent's loop. The thread enters `netns` before its first call (tests program a throwaway
namespace from the test process); a child process it forks starts there too. Calls run one at a
time, in the order they were made.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class NetnsWorker:
    """A single worker thread named `name`, inside `netns` (a name under /run/netns) when given."""

    def __init__(self, name: str, netns: str | None = None, threads: int = 1) -> None:
        """`threads` > 1: that many calls may run at once (each thread enters `netns`)."""
        self.netns = netns
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=self._enter)

    def _enter(self) -> None:
        if self.netns is not None:
            from pyroute2 import netns as pr_netns

            pr_netns.setns(self.netns)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in the worker thread, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def call(self, fn: Callable[..., T], *args: object, timeout: float | None = None) -> T:
        """fn(*args) in the worker thread, waited for by the calling thread (at most `timeout`
        seconds: TimeoutError then, and the call still runs to its end in the worker)."""
        return self._pool.submit(fn, *args).result(timeout)

    def close(self) -> None:
        """Stop the thread after the calls already made."""
        self._pool.shutdown(wait=True)
