"""Prometheus metrics with kube-proxy's names where kube-proxy has one (pkg/proxy/metrics).

Each agent owns one CollectorRegistry (tests can run several agents in one process). Names not
in kube-proxy carry the `usproxy_` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SYNC_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192, 16.384)
PROGRAMMING_BUCKETS = (0.25, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 30, 45, 60, 120, 180, 240, 300)


class Metrics:
    """The agent's metrics, all registered in `self.registry`."""

    def __init__(self) -> None:
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
