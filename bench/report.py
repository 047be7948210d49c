"""Results: bench/results/<date>.json, a markdown table (also printed) and PNG charts.

The markdown puts each contender's medians beside its ratio to the baseline (direct for
throughput and connection rate, HAProxy for the userspace peers), then every target of issue 9
with the measured value and whether this run met it. Targets are reported, never asserted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.relay_conn import table as relayconn_table

RESULTS = Path(__file__).with_name("results")
RELAYS = ("relay", "proto-protocol", "proto-splice", "proto-splice-2w")


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return fmt.format(x)


# -- targets ---------------------------------------------------------------------------------------------
Target = tuple[str, Callable[[dict[str, Any]], Any], str, float]  # label, value, comparison, bound


def _largest(rows: list[dict[str, Any]] | None, key: Callable[[dict[str, Any]], Any]) -> Any:
    rows = [r for r in rows or [] if "error" not in r]
    return key(max(rows, key=lambda r: r["services"])) if rows else None


def _min_rr(d: dict[str, Any], who: str) -> Any:
    vals = [_get(d, "dataplane", "ratio_vs_haproxy", f"rr_c{c}_rps", who) for c in (1, 16, 64)]
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def targets(who: str = "relay") -> list[Target]:
    dp = ("dataplane",)
    return [
        ("bulk relay ÷ direct", lambda d: _get(d, *dp, "ratio_vs_direct", "bulk_gbps", who), ">=", 0.7),
        ("relay CPU s per GiB", lambda d: _get(d, *dp, "cpu", "bulk_cpu_s_per_gib", who), "<=", 0.35),
        ("1 KiB req/resp relay ÷ HAProxy (worst of c=1/16/64)", lambda d: _min_rr(d, who), ">=", 1.0),
        ("new conn/s relay ÷ HAProxy", lambda d: _get(d, *dp, "ratio_vs_haproxy", "conn_cps", who), ">=", 0.8),
        ("bulk offloaded ÷ direct", lambda d: _get(d, *dp, "ratio_vs_direct", "bulk_gbps", "offloaded"), ">=", 0.97),
        ("conn/s offloaded ÷ direct", lambda d: _get(d, *dp, "ratio_vs_direct", "conn_cps", "offloaded"), ">=", 0.97),
        ("cold programming, largest size (s)",
         lambda d: _largest(_get(d, "controlplane", "usproxy_nftables"), lambda r: r["cold_s"]), "<=", 0.5),
        ("one change at largest size, p99 (ms)",
         lambda d: _largest(_get(d, "controlplane", "usproxy_nftables"), lambda r: r["one_change_s"]["p99"] * 1e3), "<=", 5.0),
        ("relay CPU per new connection, pinned beside HAProxy (µs, issue 30)",
         lambda d: _get(d, "relayconn", "median", who, "cpu_us_per_conn"), "<=", 70.0),
        ("RSS per idle relayed flow, largest N (KiB)",
         lambda d: (lambda rows: rows[-1]["bytes_per_flow"] / 1024 if rows else None)(_get(d, "memory", "relay")), "<=", 4.0),
    ]


def target_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for label, fn, op, bound in targets():
        v = fn(d)
        met = None if v is None else (v >= bound if op == ">=" else v <= bound)
        out.append({"target": label, "value": v, "op": op, "bound": bound, "met": met})
    return out


# -- markdown ----------------------------------------------------------------------------------------------
DP_ROWS = [
    ("bulk GB/s (1 GiB, 1 stream)", "bulk_gbps", "{:.2f}", "direct"),
    ("proxy CPU s/GiB", "@bulk_cpu_s_per_gib", "{:.2f}", None),
    ("1 KiB req/s c=1", "rr_c1_rps", "{:,.0f}", "haproxy"),
    ("1 KiB req/s c=16", "rr_c16_rps", "{:,.0f}", "haproxy"),
    ("1 KiB req/s c=64", "rr_c64_rps", "{:,.0f}", "haproxy"),
    ("proxy CPU s/10k req (c=16)", "@rr_c16_cpu_s_per_10k", "{:.3f}", None),
    ("new conn/s", "conn_cps", "{:,.0f}", "haproxy"),
    ("proxy CPU s/10k conns", "@conn_cpu_s_per_10k", "{:.3f}", None),
    ("latency p50 µs (at 50% of own c=16 rate)", "lat_p50_us", "{:,.0f}", None),
    ("latency p99 µs", "lat_p99_us", "{:,.0f}", None),
    ("UDP 64 B req/s", "udp_64_rps", "{:,.0f}", "direct"),
    ("UDP 1400 B req/s", "udp_1400_rps", "{:,.0f}", "direct"),
    ("proxy CPU s/10k UDP 64 B", "@udp_64_cpu_s_per_10k", "{:.3f}", None),
]


def dataplane_table(dp: dict[str, Any], unavailable: dict[str, str]) -> list[str]:
    names = list(dp["contenders"])
    head = "| metric | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for label, key, fmt, base in DP_ROWS:
        cells = []
        for n in names:
            if key.startswith("@"):
                v = _get(dp, "cpu", key[1:], n)
                cells.append(_f(v, fmt))
                continue
            v = _get(dp, "median", key, n)
            cell = _f(v, fmt)
            if base and n != base and v is not None:
                r = _get(dp, "ratio_vs_direct" if base == "direct" else "ratio_vs_haproxy", key, n)
                if r is not None:
                    cell += f" ({r:.2f}×)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for n, why in unavailable.items():
        lines.append(f"\n{n}: unavailable: {why}")
    lines.append("\nRatios in parentheses: median over rounds of (contender ÷ baseline in the same round); "
                 "baseline direct for bulk and UDP, HAProxy for req/s and conn/s.")
    return lines


TOOL_ROWS = [  # label, key, format, baselines of the ratios shown
    ("wrk -c16, Connection: close, req/s", "http_close_rps", "{:,.0f}", ("direct", "direct-routed", "haproxy")),
    ("proxy CPU s/10k new HTTP conns", "@http_close_cpu_s_per_10k", "{:.3f}", ()),
    ("wrk -c16 keep-alive req/s", "http_ka_rps", "{:,.0f}", ("direct", "direct-routed", "haproxy")),
    ("iperf3 1 TCP stream Gbit/s", "iperf_tcp1_gbps", "{:.2f}", ("direct", "direct-routed")),
    ("proxy CPU s/GiB (1 stream)", "@iperf_tcp1_cpu_s_per_gib", "{:.2f}", ()),
    ("iperf3 -P4 Gbit/s", "iperf_tcp4_gbps", "{:.2f}", ("direct", "direct-routed")),
    ("iperf3 -u 1400 B received Gbit/s", "iperf_udp1400_gbps", "{:.3f}", ("direct", "direct-routed")),
    ("proxy CPU s/GiB UDP", "@iperf_udp1400_cpu_s_per_gib", "{:.2f}", ()),
    ("redis-benchmark -c16 SET req/s", "redis_set_rps", "{:,.0f}", ("direct", "direct-routed", "haproxy")),
    ("redis-benchmark -c16 GET req/s", "redis_get_rps", "{:,.0f}", ("direct", "direct-routed", "haproxy")),
]


def tools_table(tp: dict[str, Any]) -> list[str]:
    if "error" in tp:
        return [f"unavailable: {tp['error']}"]
    names = list(tp["contenders"])
    lines = ["| tool | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for label, key, fmt, bases in TOOL_ROWS:
        cells = []
        for n in names:
            table = "cpu" if key.startswith("@") else "median"
            v = _get(tp, table, key.lstrip("@"), n)
            cell = _f(v, fmt)
            ratios = [f"{r:.2f}× {b}" for b in bases if n != b and v is not None
                      for r in [_get(tp, f"ratio_vs_{b}", key, n)] if r is not None]
            cells.append(cell + (f" ({', '.join(ratios)})" if ratios else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("\nRatios: median over rounds of (contender ÷ baseline in the same round). Proxy CPU from /proc "
                 "around each tool run (start-up included). HAProxy 2.6 has no UDP. direct-routed: the pod "
                 "through the node's IP forwarding, no NAT (see bench/topology.py; its UDP row is iperf3's own, bound "
                 "to the routed address).")
    return lines


def controlplane_table(cp: dict[str, Any]) -> list[str]:
    lines = ["| Services × 2 endpoints | usproxy nftables cold (s) | one change p50 / p99 (ms) | "
             "kube-proxy layout `nft -f` cold (s) | its one change p50 (ms) | relay first sync (s) | relay one change p50 (ms) |",
             "|---|---|---|---|---|---|---|"]
    us = {r["services"]: r for r in cp.get("usproxy_nftables", [])}
    kp = {r["services"]: r for r in cp.get("kube_proxy_nftables", [])}
    rl = {r["services"]: r for r in cp.get("relay", [])}
    for n in sorted(set(us) | set(kp) | set(rl)):
        u, k, r = us.get(n, {}), kp.get(n, {}), rl.get(n, {})
        lines.append(
            f"| {n:,} | {_f(u.get('cold_s'), '{:.3f}')} | "
            f"{_ms(_get(u, 'one_change_s', 'p50'))} / "
            f"{_ms(_get(u, 'one_change_s', 'p99'))} | {_f(k.get('cold_s'), '{:.2f}')}{' ' + k['error'][:60] if 'error' in k else ''} | "
            f"{_ms(_get(k, 'one_change_s', 'p50'))} | {_f(r.get('cold_first_sync_s'), '{:.2f}')} | "
            f"{_ms(_get(r, 'one_change_sync_s', 'p50'))} |")
    ext = cp.get("nft_scale")
    if isinstance(ext, list) and ext:
        lines.append("\nNftablesDatapath.apply() alone (bench/nft_scale.py, no Proxier; cold = median of 3; "
                     "endpoints on 1 node = every one hairpins, on 50 = one node of a 50-node cluster): " + "; ".join(
            f"{r['services']:,} on {r.get('nodes', 1)}: cold {r['cold_s']:.3f} s, one change p50 {r['one_change_p50_ms']:.2f} / "
            f"p99 {r['one_change_p99_ms']:.2f} ms" for r in ext))
    for e in cp.get("edit_to_connection", []):
        lines.append(f"\nEdit of the manifest → first connection reaching the new endpoint ({e.get('offload')}): "
                     + (f"p50 {_ms(e.get('p50'))} ms, max {_ms(e.get('max'))} ms over {e.get('n')} edits"
                        if "p50" in e else f"unavailable: {e.get('error')}"))
    return lines


def _ms(x: Any) -> str:
    return _f(None if x is None else x * 1e3, "{:.2f}")


def memory_table(mem: dict[str, Any]) -> list[str]:
    lines = ["| proxy | idle flows | RSS before (MiB) | RSS after (MiB) | KiB per flow |", "|---|---|---|---|---|"]
    for name, rows in mem.items():
        for r in rows:
            lines.append(f"| {name} | {r['flows']:,} | {r['rss_before'] / 2**20:.1f} | {r['rss_after'] / 2**20:.1f} | "
                         f"{r['bytes_per_flow'] / 1024:.2f} |")
    return lines


def targets_table(d: dict[str, Any]) -> list[str]:
    lines = ["| target | bound | this run | met |", "|---|---|---|---|"]
    for t in target_rows(d):
        lines.append(f"| {t['target']} | {t['op']} {t['bound']:g} | {_f(t['value'], '{:.3f}')} | "
                     f"{'–' if t['met'] is None else ('yes' if t['met'] else 'no')} |")
    return lines


def prototype_table(dp: dict[str, Any]) -> list[str]:
    names = [n for n in RELAYS if n in dp["contenders"]]
    if len(names) < 2:
        return []
    rows = [("bulk ÷ direct", "ratio_vs_direct", "bulk_gbps"), ("CPU s/GiB", "cpu", "bulk_cpu_s_per_gib"),
            ("req/s c=1 ÷ HAProxy", "ratio_vs_haproxy", "rr_c1_rps"), ("req/s c=16 ÷ HAProxy", "ratio_vs_haproxy", "rr_c16_rps"),
            ("req/s c=64 ÷ HAProxy", "ratio_vs_haproxy", "rr_c64_rps"), ("conn/s ÷ HAProxy", "ratio_vs_haproxy", "conn_cps"),
            ("CPU s/10k req (c=16)", "cpu", "rr_c16_cpu_s_per_10k"), ("latency p99 µs", "median", "lat_p99_us")]
    lines = ["| relay (before → prototypes) | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for label, table, key in rows:
        lines.append(f"| {label} | " + " | ".join(_f(_get(dp, table, key, n), "{:.3f}" if "µs" not in label else "{:,.0f}")
                                                for n in names) + " |")
    return lines


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    out = [f"### usproxy bench, {m['date']} ({m['mode']})", "",
           f"Machine: {m['machine']}. Rounds: {m['rounds']}, interleaved; medians of per-round ratios. "
           f"Reproduce: `{m['command']}`.", ""]
    if "dataplane" in d:
        out += ["#### Data plane", ""] + dataplane_table(d["dataplane"], d.get("unavailable", {})) + [""]
        proto = prototype_table(d["dataplane"])
        if proto:
            out += ["#### Relay prototypes (bench/prototypes/relay_proto.py), same rounds", ""] + proto + [""]
    if "relayconn" in d:
        out += ["#### Relay CPU per new connection, beside HAProxy on the same pinned core (issue 30)", ""]
        out += relayconn_table(d["relayconn"]) + [""]
    if "tools" in d:
        out += ["#### Real tools (wrk, iperf3, redis-benchmark against nginx, iperf3 -s, redis-server)", ""]
        out += tools_table(d["tools"]) + [""]
    if "controlplane" in d:
        out += ["#### Control plane", ""] + controlplane_table(d["controlplane"]) + [""]
    if "startup" in d:
        from bench.startup import table

        out += ["#### Control plane end to end (bench/startup.py)", ""] + table(d["startup"]) + [""]
    if "memory" in d:
        out += ["#### Memory", ""] + memory_table(d["memory"]) + [""]
    out += ["#### Targets (issue 9; reported, not asserted)", ""] + targets_table(d) + [""]
    if d.get("profile"):
        out += ["#### Relay profile (py-spy, self time)", ""]
        for label, rows in d["profile"].items():
            out.append(f"- {label}: " + "; ".join(f"{r['function']} {r['share'] * 100:.0f}%" for r in rows[:10]))
        out.append("")
    return "\n".join(out)


# -- charts ----------------------------------------------------------------------------------------------
def charts(d: dict[str, Any], stem: str) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # optional: the tables are the results
        print("bench: no charts (matplotlib is not installed: pip install matplotlib)", flush=True)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    dp = d.get("dataplane")
    if dp:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
        metrics = [("bulk_gbps", "bulk"), ("rr_c1_rps", "rr c1"), ("rr_c16_rps", "rr c16"), ("rr_c64_rps", "rr c64"),
                   ("conn_cps", "conn/s"), ("udp_64_rps", "udp 64"), ("udp_1400_rps", "udp 1400")]
        names = [n for n in dp["contenders"] if n != "direct"]
        width = 0.8 / max(1, len(names))
        for j, n in enumerate(names):
            vals = [_get(dp, "ratio_vs_direct", k, n) or 0 for k, _ in metrics]
            axes[0].bar([i + j * width for i in range(len(metrics))], vals, width, label=n)
        axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(metrics))], [lbl for _, lbl in metrics], rotation=30)
        axes[0].axhline(1.0, color="grey", lw=0.5)
        axes[0].set_title("throughput ÷ direct (median of rounds)")
        axes[0].legend(fontsize=7)
        lat = [(n, _get(dp, "median", "lat_p50_us", n), _get(dp, "median", "lat_p99_us", n)) for n in dp["contenders"]]
        lat = [x for x in lat if x[1] is not None]
        axes[1].bar([x[0] for x in lat], [x[2] for x in lat], label="p99", color="tab:orange")
        axes[1].bar([x[0] for x in lat], [x[1] for x in lat], label="p50", color="tab:blue")
        axes[1].set_ylabel("µs")
        axes[1].set_title("1 KiB latency at 50% of own capacity")
        axes[1].tick_params(axis="x", rotation=30)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        paths.append(RESULTS / f"{stem}-dataplane.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    cp = d.get("controlplane")
    if cp:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
        for key, label in (("usproxy_nftables", "usproxy nftables"), ("kube_proxy_nftables", "kube-proxy layout nft -f")):
            rows = [r for r in cp.get(key, []) if "cold_s" in r]
            axes[0].plot([r["services"] for r in rows], [r["cold_s"] for r in rows], "o-", label=label)
            axes[1].plot([r["services"] for r in rows], [r["one_change_s"]["p50"] * 1e3 for r in rows if "one_change_s" in r],
                         "o-", label=label)
        rows = cp.get("relay", [])
        if rows:
            axes[0].plot([r["services"] for r in rows], [r["cold_first_sync_s"] for r in rows], "s--", label="relay first sync")
            axes[1].plot([r["services"] for r in rows], [(r["one_change_sync_s"].get("p50") or 0) * 1e3 for r in rows], "s--",
                         label="relay sync")
        for ax, t in ((axes[0], "cold programming (s)"), (axes[1], "one endpoint change p50 (ms)")):
            ax.set_yscale("log")
            ax.set_xlabel("Services × 2 endpoints")
            ax.set_title(t)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(RESULTS / f"{stem}-controlplane.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def write(d: dict[str, Any], stem: str) -> tuple[Path, Path, list[Path]]:
    RESULTS.mkdir(exist_ok=True)
    d["targets"] = target_rows(d)
    jp = RESULTS / f"{stem}.json"
    jp.write_text(json.dumps(d, indent=1, default=str))
    mp = RESULTS / f"{stem}.md"
    mp.write_text(markdown(d))
    return jp, mp, charts(d, stem)
