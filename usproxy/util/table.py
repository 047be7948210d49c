"""Plain-text tables for `usproxy status`, `usproxy flows` and `usproxy check` (the rows of
/services and /flows are usproxy/util/rows.py's)."""

from __future__ import annotations

from collections.abc import Sequence

from usproxy.util.rows import FlowRow, ServiceRow


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def render_services(rows: Sequence[ServiceRow]) -> str:
    out = []
    for r in rows:
        eps = ",".join(e["address"] for e in r["endpoints"] if e["usable"]) or "<none>"
        front = ",".join(r["clusterIPs"]) + f":{r['port']}"
        why = r["reason"] + (f"; external: {r['externalReason']}" if r.get("externalReason") else "")
        out.append([r["servicePortName"], r["protocol"], front, r["nodePort"] or "-",
                    eps, r["datapath"], r.get("external") or "-", why])
    return render_table(["SERVICE PORT", "PROTO", "CLUSTER-IP:PORT", "NODEPORT", "ENDPOINTS",
                         "DATAPATH", "EXTERNAL", "WHY"], out)


def _seconds(value: float | None) -> str:
    """A flow's age or idle time; `-` where the datapath does not know it (a kernel conntrack
    entry carries no start time unless nf_conntrack_timestamp is on)."""
    return "-" if value is None else f"{value:.1f}s"


def render_flows(rows: Sequence[FlowRow]) -> str:
    """One line per flow, in the manner of `conntrack -L`."""
    lines = []
    for f in rows:
        o, r = f["original"], f["reply"]
        lines.append(
            f"{f['protocol'].lower():<4} {f['state']:<12} age={_seconds(f['age'])} idle={_seconds(f['idle'])} "
            f"src={o['src']} dst={o['dst']} packets={f['packets_in']} bytes={f['bytes_in']} "
            f"src={r['src']} dst={r['dst']} packets={f['packets_out']} bytes={f['bytes_out']} "
            f"[{f['datapath']}] {f['service']}")
    lines.append(f"usproxy flows: {len(rows)} flow entries have been shown.")
    return "\n".join(lines)
