"""Prometheus metrics with kube-proxy's names where kube-proxy has one (pkg/proxy/metrics).

Each agent owns one CollectorRegistry (tests can run several agents in one process). Names not
in kube-proxy carry the `usproxy_` prefix.

A scrape (`Metrics.scrape`) first lets each staged collector compute its values on the loop a few
milliseconds at a time (counting 5,000 ServicePorts' placements in one piece held the loop
~10 ms), then renders the text in one short call, with those values installed only for that call:
a collector read any other way (a test's `generate_latest`) computes its values itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SYNC_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192, 16.384)
PROGRAMMING_BUCKETS = (0.25, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 30, 45, 60, 120, 180, 240, 300)


class StagedCollector(Protocol):
    """A collector whose values are computed before a scrape renders them (see the module docstring)."""

    staged: Any  # the values `stage()` computed, set only while a scrape renders; else None

    async def stage(self) -> Any: ...

    def collect(self) -> Any: ...


class Metrics:
    """The agent's metrics, all registered in `self.registry`."""

    def __init__(self) -> None:
        self._staged: list[StagedCollector] = []
        r = self.registry = CollectorRegistry()
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds",
            registry=r, buckets=SYNC_BUCKETS)
        self.sync_last_timestamp = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced", registry=r)
        self.sync_last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued", registry=r)
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds", registry=r, buckets=PROGRAMMING_BUCKETS)
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes", registry=r)
        self.endpoint_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", registry=r)
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", registry=r)
        self.service_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", registry=r)
        self.sync_failures = Counter(
            "usproxy_sync_failures", "Syncs that raised and were retried", registry=r)
        self.config_errors = Counter(
            "usproxy_config_errors", "Objects skipped because they were invalid", ["kind"], registry=r)
        self.demotions = Counter(
            "usproxy_offload_demotions", "ServicePorts sent back to userspace", ["datapath", "reason"], registry=r)

    def register_staged(self, collector: StagedCollector) -> None:
        """Register `collector`, its values staged before each `scrape`."""
        self.registry.register(collector)
        self._staged.append(collector)

    async def scrape(self) -> bytes:
        """The registry in Prometheus text format (as `generate_latest`), its staged collectors'
        values computed first, with the loop running between their chunks. Nothing is awaited
        between installing them and rendering, so a concurrent scrape never sees them."""
        values = [await c.stage() for c in self._staged]
        for c, v in zip(self._staged, values):
            c.staged = v
        try:
            return generate_latest(self.registry)
        finally:
            for c in self._staged:
                c.staged = None
