"""Read the pinned socket LB without changing it: text for `explain --live`, rows for /flows.

`render_pinned()` opens the pinned maps read-only (BPF_OBJ_GET; nothing is loaded or attached),
so it works from any process while an agent runs, or with no agent at all after one exited. The
views follow what `cilium-dbg bpf lb list` and `cilium-dbg bpf lb maglev list` show: per frontend
the slot -> backend table, plus the affinity entries and the sockets the programs steered.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader, nodeport
from usproxy.offload.pin_root import default_pin_root
from usproxy.offload.bpf.layout import (
    CT_ORIGINAL,
    F_AFFINITY,
    F_DROP_EMPTY,
    F_LOCAL_ONLY,
    F_DSR,
    F_MAGLEV,
    F_ROUND_ROBIN,
    F_SOURCE_RANGES,
    F_TC_ONLY,
    PROTO_NAMES,
    AffinityEntry,
    FlowVal,
)
from usproxy.offload.bpf.tables import Group, Tables
from usproxy.model.types import ServicePortName, format_hostport
from usproxy.util.rows import FlowRow


def spn_text(key: str) -> str:
    """A service group's name (a ServicePortName key) as the ServicePortName prints."""
    spn = ServicePortName.from_key(key)
    return str(spn) if spn else key


def group_lines(groups: Mapping[int, Group], selected: Mapping[int, int]) -> list[str]:
    """Per service group: its entry, frontends and slots (with selection counts if given)."""
    lines: list[str] = []
    for g in sorted(groups.values(), key=lambda g: (g.name, g.id)):
        lines += _group_lines(g, selected)
    return lines


def _group_lines(g: Group, selected: Mapping[int, int]) -> list[str]:
    bits = ((F_AFFINITY, "affinity"), (F_MAGLEV, "maglev"), (F_ROUND_ROBIN, "roundRobin"))
    flags = [n for bit, n in bits if g.val.flags & bit] or ["random"]
    head = f"service {g.name} id={g.id} count={g.val.count} select={','.join(flags)}"
    if g.val.flags & F_AFFINITY:
        head += f" timeout={g.val.affinity_timeout}s"
    if g.val.flags & F_DSR:
        head += " mode=dsr"
    tc = [n for bit, n in ((F_LOCAL_ONLY, "local-only"), (F_SOURCE_RANGES, "source-ranges"),
                           (F_DROP_EMPTY, "drop-if-empty")) if g.val.flags & bit]
    if g.val.flags & F_TC_ONLY:  # a group of the tc programs (NodePort, externalIPs, LB IPs)
        head += " tc" + (f"={','.join(tc)}" if tc else "")
    lines = [head]
    for key in sorted(g.frontends):
        lines.append(f"  frontend {format_hostport(key.ip, key.port)}/{PROTO_NAMES.get(key.proto, key.proto)}")
    for i, bid in enumerate(g.slots, 1):
        ip, port = g.backends[bid]
        extra = f" selected={selected.get(bid, 0)}" if selected else ""
        lines.append(f"  slot {i} -> backend {bid} {format_hostport(ip, port)}{extra}")
    if g.maglev is not None:
        lines.append(f"  maglev table {len(g.maglev)} entries")
    return lines


def flow_row(f: FlowVal, groups: Mapping[int, Group], now: int) -> FlowRow:
    """One steered socket as a /flows row (usproxy/util/rows.py). The client is
    named by its netns cookie: at connect() the socket has no source address yet."""
    g = groups.get(f.svc_id)
    proto = PROTO_NAMES.get(f.proto, str(f.proto))
    return {
        "protocol": proto, "state": "CONNECTED" if proto == "TCP" else "STEERED",
        "age": max(0, now - f.created) / 1e9, "idle": max(0, now - f.last) / 1e9,
        "original": {"src": f"netns:{f.netns}", "dst": format_hostport(f.svc_ip, f.svc_port)},
        "reply": {"src": format_hostport(f.be_ip, f.be_port), "dst": f"netns:{f.netns}"},
        "packets_in": f.packets, "bytes_in": 0, "packets_out": 0, "bytes_out": 0,
        "datapath": "bpf", "service": spn_text(g.name) if g else f"<service {f.svc_id}>",
    }


def affinity_row(e: AffinityEntry, groups: Mapping[int, Group], now: int) -> dict[str, Any]:
    g = groups.get(e.svc_id)
    addr = g.backends.get(e.backend_id) if g else None
    return {"client": f"netns:{e.client}", "service": spn_text(g.name) if g else str(e.svc_id),
            "endpoint": format_hostport(*addr) if addr else str(e.backend_id),
            "idle": max(0, now - e.last_used) / 1e9}


# maps newer than the first pinned layout: pins of an agent from before them lack them
OPTIONAL_MAPS = frozenset({"usp_ct_any", "usp_ct_new", "usp_frags", "usp_dsr_peers", "usp_backend_ids"})


def render_pinned(pin_root: Path | None = None) -> str | None:
    """The pinned socket LB as text, or None when nothing is pinned at `pin_root`."""
    pins = loader.PinLayout(pin_root or default_pin_root())
    if not pins.exists():
        return None
    fds: dict[str, int] = {}
    try:
        for name in loader.MAPS:
            if (pins.maps / name).exists() or name not in OPTIONAL_MAPS:
                fds[name] = bpf.obj_get(str(pins.maps / name))
        return _render(pins, Tables(fds))
    finally:
        for fd in fds.values():
            os.close(fd)


def _render(pins: loader.PinLayout, tables: Tables) -> str:
    groups = tables.read_groups()
    selected = {b: v.selected for b, v in tables.backends().items()}
    now = time.monotonic_ns()
    out = [f"# bpf socket LB pinned at {pins.base}"]
    for prog, info in loader.attached_links(pins).items():
        where = f"ifindex={info['ifindex']}" if "ifindex" in info else f"cgroup_id={info.get('cgroup_id')}"
        kind = "tc filter (clsact)" if info.get("link_type") == "cls_bpf" else "link"
        out.append(f"{kind} {prog}: prog_id={info.get('prog_id')} {where}")
    out += group_lines(groups, selected)
    for e in tables.affinity():
        r = affinity_row(e, groups, now)
        out.append(f"affinity {r['client']} {r['service']} -> {r['endpoint']} idle={r['idle']:.1f}s")
    flows = bpf.map_items(tables.fds["usp_flows"], FlowVal.KEY_SIZE, FlowVal.SIZE)
    out.append(f"steered sockets open: {len(flows)}")
    for _, raw in flows[:50]:
        row = flow_row(FlowVal.unpack(raw), groups, now)
        out.append(f"  {row['protocol'].lower()} {row['original']['src']} {row['original']['dst']} -> "
                   f"{row['reply']['src']} age={row['age']:.1f}s [{row['service']}]")
    return "\n".join(out + _ct_lines(tables, groups, now))


def _ct_lines(tables: Tables, groups: Mapping[int, Group], now: int) -> list[str]:
    """The tc NodePort flows (ORIGINAL conntrack entries), as `cilium-dbg bpf ct list` lists."""
    entries = [e for e in nodeport.ct_entries(tables.fds) if e.direction == CT_ORIGINAL]
    out = [f"tc NodePort flows: {len(entries)} ({sum(not e.confirmed for e in entries)} not confirmed yet)"]
    for e in entries[:50]:
        r = nodeport.ct_row(e, spn_text(groups[e.svc_id].name) if e.svc_id in groups else str(e.svc_id), now)
        out.append(f"  {r['protocol'].lower()} {r['original']['src']} -> {r['original']['dst']} => "
                   f"{r['reply']['dst']} -> {r['reply']['src']} idle={r['idle']:.1f}s [{r['service']}]")
    return out
