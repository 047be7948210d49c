"""Health as kube-proxy's ProxierHealthServer (pkg/proxy/healthcheck/proxier_health.go).

Healthy while starting up (nothing queued yet) and whenever the oldest change not yet synced was
queued less than `health_timeout` seconds ago (kube-proxy uses 2 × syncPeriod). The body is the
same JSON: lastUpdated, currentTime, nodeEligible.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool
    last_updated: float | None
    current_time: float
    node_eligible: bool = True

    def body(self) -> dict[str, object]:
        return {
            "lastUpdated": _go_time(self.last_updated),
            "currentTime": _go_time(self.current_time),
            "nodeEligible": self.node_eligible,
        }


def _go_time(ts: float | None) -> str:
    """Go's time.Time.String() form, as kube-proxy prints it ("0001-01-01 ..." for zero)."""
    if ts is None:
        return "0001-01-01 00:00:00 +0000 UTC"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC")


def evaluate(last_updated: float | None, oldest_queued: float | None, health_timeout: float,
             now: float | None = None) -> Health:
    """kube-proxy's rule: unhealthy only when a queued change waited longer than the timeout."""
    now = time.time() if now is None else now
    healthy = oldest_queued is None or now - oldest_queued < health_timeout
    return Health(healthy, last_updated, now)
