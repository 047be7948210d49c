"""NetlinkWorker: one thread owning one pyroute2 IPRoute socket.

pyroute2's synchronous API cannot run inside a running event loop and its asynchronous API fails
under uvloop (docs/platform.md#pyroute2-and-uvloop), so every rtnetlink call of the agent (the
ClusterIP interface, `usproxy check`'s link probes) runs in a worker thread of its own, with an
IPRoute built on a private selector loop. Calls run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class NetlinkWorker:
    """One thread owning one pyroute2 IPRoute socket."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="netlink")
        self._ipr: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None  # pyroute2's own, in the thread

    def _ip(self) -> Any:
        if self._ipr is None:
            from pyroute2 import IPRoute

            self._loop = asyncio.SelectorEventLoop()
            self._ipr = IPRoute(use_event_loop=self._loop)
        return self._ipr

    def call_sync(self, fn: Callable[[Any], T]) -> T:
        return self._pool.submit(lambda: fn(self._ip())).result()

    async def call(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self._pool.submit(lambda: fn(self._ip())))

    def close(self) -> None:
        def shut() -> None:
            if self._ipr is not None:
                self._ipr.close()
                self._ipr = None
            if self._loop is not None:  # IPRoute.close leaves the loop it was given open
                self._loop.run_until_complete(asyncio.sleep(0))  # its transports' close callbacks
                self._loop.close()
                self._loop = None
        self._pool.submit(shut).result()
        self._pool.shutdown(wait=True)
