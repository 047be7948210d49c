"""The tour's plots, from its ModeResults, each with the one sentence that says what it shows and
how it was measured (results.json's "plots", shown under each plot by the web view and the
`--html` page).

- match-rate.svg: new connections per second against the number of Services, per mode, for the
  Service first in the rule order (dashed) and the last (solid);
- match-latency-p50.svg, match-latency-p99.svg: the latency of one new connection, same lines;
- update-time.svg: the time one endpoint change takes to reach the first new connection;
- update-writes.svg: what the datapath sent to the kernel for that change (the relay sends
  nothing, so it has no line);
- uniformity.svg: each endpoint's share of the uniformity test's connections, per mode, with the
  chi-square p-value in the mode's name.
Modes that did not run have no line; the captions are written from the plan and the results, so
they state what this run measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from usproxy.tour.results import MatchCost, ModeResult, Plot, UpdateCost
from usproxy.tour.svg import Bar, Series, bar_chart, line_chart
from usproxy.tour.visit import Plan

COLORS = {"relay": "#8c564b", "iptables": "#d62728", "ipvs": "#9467bd", "nftables": "#1f77b4", "bpf": "#2ca02c"}
ENDPOINT_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1")
SIZES_LABEL = "Services (log scale)"


def _measured(modes: Sequence[ModeResult]) -> list[ModeResult]:
    return [r for r in modes if r.available and (r.match or r.update or r.uniformity)]


def _sizes(modes: Sequence[ModeResult]) -> list[tuple[float, str]]:
    sizes = sorted({c.services for r in modes for c in r.match} | {u.services for r in modes for u in r.update})
    return [(float(n), f"{n:,}") for n in sizes]


def _match_series(modes: Sequence[ModeResult], value: Callable[[MatchCost], float]) -> list[Series]:
    out = []
    for r in _measured(modes):
        for position, dashed in (("last", False), ("first", True)):
            pts = tuple((float(c.services), value(c)) for c in r.match if c.position == position)
            if pts:
                out.append(Series(f"{r.mode}, {position}", pts, COLORS.get(r.mode, "#555"), dashed))
    return out


def write_all(out: Path, modes: Sequence[ModeResult], plan: Plan) -> list[Plot]:
    """Every plot into `out`; their captions, in the order they are best read."""
    sizes = _sizes(modes)
    names = ", ".join(f"{n:,}" for n in plan.sizes)
    plots: list[tuple[str, str, str]] = []
    who = "a client on the node in the tour's own network namespaces"
    plots.append(("match-rate.svg", line_chart(
        "New connections per second", SIZES_LABEL, "connections/s",
        _match_series(modes, lambda c: c.conns_per_s), x_names=sizes),
        f"New connections per second to the Service first (dashed) and last (solid) in iptables' rule order, as "
        f"the number of Services grows ({names}): {who} kept {plan.conc} short connections in flight, each "
        f"answered by one of five endpoints; a point is the best of {plan.rounds} windows of {plan.window:g} s."))
    for q in ("p50", "p99"):
        plots.append((f"match-latency-{q}.svg", line_chart(
            f"Latency of one new connection, {q}", SIZES_LABEL, "microseconds",
            _match_series(modes, lambda c, q=q: c.latency_p50_us if q == "p50" else c.latency_p99_us),  # type: ignore[misc]
            x_names=sizes),
            f"The {q} of the time from connect() to the endpoint's answer and close, over "
            f"{plan.rounds * plan.latency_count} connections made one at a time to the Service first (dashed) and "
            f"last (solid) in iptables' rule order, at each number of Services."))
    plots.append(("update-time.svg", line_chart(
        "Time for one endpoint change to take effect", SIZES_LABEL, "milliseconds (log scale)",
        _update_series(modes, lambda r, u: (u.median_s or 0) * 1000)
        + _update_series(modes, lambda r, u: u.sync_median_s * 1000, dashed=True), log_y=True, x_names=sizes),
        f"Solid: the median over {plan.changes} changes of the time from the manifest's rename (one endpoint of "
        f"one Service replaced) to the first new connection the new endpoint answered (polled every 2 ms), the "
        f"agent reading the file included; dashed: the agent's own sync time for the change "
        f"(kubeproxy_sync_proxy_rules_duration_seconds), at each number of Services."))
    plots.append(("update-writes.svg", line_chart(
        "What one endpoint change sends to the kernel", SIZES_LABEL, "writes (log scale)",
        _update_series(modes, _writes, units=True), log_y=True, x_names=sizes),
        "What the datapath sent to the kernel for one endpoint change, read from the agent's own counter "
        "usproxy_kernel_writes_total before and after the change's sync: lines of iptables-restore input, "
        "operations of the nftables transaction, BPF map elements written (the relay sends nothing: it picks "
        "endpoints itself)."))
    uni = [r for r in _measured(modes) if r.uniformity is not None]
    n = uni[0].uniformity.connections if uni and uni[0].uniformity else plan.uniform_count
    plots.append(("uniformity.svg", bar_chart(
        "Share of connections per endpoint", "% of the connections",
        [(f"{r.mode} (p={r.uniformity.p_value:.2f})", [
            Bar(ep, 100 * c / max(1, r.uniformity.connections), ENDPOINT_COLORS[i % len(ENDPOINT_COLORS)])
            for i, (ep, c) in enumerate(zip(r.uniformity.endpoints, r.uniformity.counts))])
         for r in uni if r.uniformity is not None],
        reference=20.0, reference_label="uniform: 20 %",
        legend=[(ep, ENDPOINT_COLORS[i]) for i, ep in enumerate(uni[0].uniformity.endpoints)]
        if uni and uni[0].uniformity else ()),
        f"Each of the five endpoints' share of about {n:,} new connections to one Service (16 in flight), per "
        f"mode, with --lb-policy random; p is the chi-square test's p-value against a uniform choice (p below "
        f"0.05 would say the choice is not uniform)."))
    for name, text, _ in plots:
        (out / name).write_text(text)
    return [Plot(name, caption) for name, _, caption in plots]


def _writes(r: ModeResult, u: UpdateCost) -> float:
    return float(statistics.median(u.kernel_writes)) if u.kernel_writes else 0.0


def _update_series(modes: Sequence[ModeResult], value: Callable[[ModeResult, UpdateCost], float],
                   units: bool = False, dashed: bool = False) -> list[Series]:
    """One line per mode; with `units`, only modes whose datapath counts its kernel writes."""
    out = []
    for r in _measured(modes):
        if units and not any(u.unit for u in r.update):
            continue
        pts = tuple((float(u.services), value(r, u)) for u in r.update)
        if pts:
            out.append(Series(r.mode + (", sync" if dashed else ""), pts, COLORS.get(r.mode, "#555"), dashed))
    return out
