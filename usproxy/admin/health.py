"""Health as kube-proxy's ProxierHealthServer (pkg/proxy/healthcheck/proxier_health.go).

Healthy while starting up (nothing queued yet) and whenever the oldest change not yet synced was
queued less than `health_timeout` seconds ago (kube-proxy uses 2 × syncPeriod). The body is the
same JSON: lastUpdated, currentTime, nodeEligible; and, while syncs fail, usproxy's
`lastSyncError` (what the last one raised) and `failingSince`, so a probe's body says what is
wrong. Syncs failing for longer than `health_timeout` are unhealthy too, queued change or not.
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
    error: str | None = None  # the last sync's failure (None: it succeeded)
    failing_since: float | None = None  # wall time of the first of the failures in a row

    def body(self) -> dict[str, object]:
        out: dict[str, object] = {
            "lastUpdated": _go_time(self.last_updated),
            "currentTime": _go_time(self.current_time),
            "nodeEligible": self.node_eligible,
        }
        if self.error is not None:
            out["lastSyncError"] = self.error
            out["failingSince"] = _go_time(self.failing_since)
        return out


def _go_time(ts: float | None) -> str:
    """Go's time.Time.String() form, as kube-proxy prints it ("0001-01-01 ..." for zero)."""
    if ts is None:
        return "0001-01-01 00:00:00 +0000 UTC"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC")


def evaluate(last_updated: float | None, oldest_queued: float | None, health_timeout: float,
             now: float | None = None, *, error: str | None = None,
             failing_since: float | None = None) -> Health:
    """kube-proxy's rule: unhealthy when a queued change waited longer than the timeout; and
    when syncs have failed (`error`) for longer than it."""
    now = time.time() if now is None else now
    healthy = oldest_queued is None or now - oldest_queued < health_timeout
    if error is not None and failing_since is not None and now - failing_since >= health_timeout:
        healthy = False
    return Health(healthy, last_updated, now, error=error, failing_since=failing_since)
