"""FlowTableCollector: the flow table's Prometheus metrics, read at scrape time.

usproxy_flows_total{protocol} (flows created), usproxy_conntrack_entries{protocol} (live flows),
usproxy_flow_bytes_total{direction} (bytes of flows that ended; original = client to endpoint),
usproxy_flows_refused_total{reason} (refused because the table was full, as kube-proxy's
conntrack max). Collecting at scrape keeps every Prometheus call off the relay's per-flow path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from usproxy.flows.flow_table import FlowTable


class FlowTableCollector:
    def __init__(self, table: FlowTable) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        t = self.table
        protocols = sorted({"TCP", "UDP", *t.opened})
        opened = CounterMetricFamily("usproxy_flows", "Flows created", labels=["protocol"])
        live = GaugeMetricFamily("usproxy_conntrack_entries", "Current flows in the flow table",
                                 labels=["protocol"])
        for p in protocols:
            opened.add_metric([p], t.opened.get(p, 0))
            live.add_metric([p], t.live.get(p, 0))
        done = CounterMetricFamily("usproxy_flow_bytes", "Bytes relayed by flows that ended",
                                   labels=["direction"])
        done.add_metric(["original"], t.bytes_done[0])
        done.add_metric(["reply"], t.bytes_done[1])
        refused = CounterMetricFamily("usproxy_flows_refused", "New flows refused", labels=["reason"])
        refused.add_metric(["conntrack_max"], t.refused - t.refused_fair_share)
        refused.add_metric(["fair_share"], t.refused_fair_share)
        timed_out = CounterMetricFamily("usproxy_flows_timed_out", "Relayed flows reset for idling past their timeout")
        timed_out.add_metric([], t.timed_out)
        yield from (opened, live, done, refused, timed_out)
