"""`usproxy flows` lines (usproxy/util/table.py render_flows): a kernel conntrack entry, which carries no
start time, shows its age and idle time as `-`, never as a made-up 0.0 s; a relayed flow shows its own."""

from __future__ import annotations

from usproxy.util.rows import FlowRow
from usproxy.util.table import render_flows


def row(age: float | None, idle: float | None, datapath: str) -> FlowRow:
    return {"protocol": "TCP", "state": "ESTABLISHED", "age": age, "idle": idle,
            "original": {"src": "10.244.9.10:40000", "dst": "10.96.10.10:80"},
            "reply": {"src": "10.244.1.5:8080", "dst": "10.244.9.10:40000"},
            "packets_in": 0, "bytes_in": 0, "packets_out": 0, "bytes_out": 0,
            "datapath": datapath, "service": "default/web:http/TCP"}


def test_a_kernel_flow_without_a_start_time_shows_no_age() -> None:
    line = render_flows([row(None, None, "nftables")]).splitlines()[0]
    assert " age=- idle=- " in line and "[nftables]" in line


def test_a_relayed_flow_shows_its_age_and_idle_time() -> None:
    line = render_flows([row(12.34, 0.5, "userspace")]).splitlines()[0]
    assert " age=12.3s idle=0.5s " in line
