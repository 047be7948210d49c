"""RateLimitedLog: log a recurring message at most once per interval, counting what it dropped.

Used on the relay's per-connection paths (endpoint failures, EMFILE, ICMP errors), where a fault
can repeat thousands of times a second.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def _allow(self, key: str) -> int | None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._dropped.pop(key, 0)

    def warning(self, msg: str, *args: object) -> None:
        dropped = self._allow(msg)
        if dropped is not None:
            suffix = f" (and {dropped} more like it)" if dropped else ""
            self.logger.warning(msg + suffix, *args)
