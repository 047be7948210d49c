"""What a tour measured, as values, and results.json.

results.json holds `tour` (when, where, the plan, the machine's load, seconds taken), `modes`
(one ModeResult per mode in the tour's order, also the modes this machine lacks, with why),
and `plots` ({"file", "caption"} per plot): the format `explain --html --tour-results DIR` and
`usproxy run --tour-results DIR` read (usproxy/explain/page_sections.py). Every figure says
which Service it was measured on, at how many Services, and from how many connections.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Position = Literal["first", "last"]


@dataclass(frozen=True, slots=True)
class MatchCost:
    """New connections to one Service at one size: the rate with `conc` in flight (the best of
    the rounds' windows), and the latency of connections made one at a time (every round's)."""

    services: int
    position: Position
    service: str  # its ServicePortName
    rules_walked: int | None  # iptables: the position of its rule in KUBE-SERVICES, read from the kernel
    conns_per_s: float
    conc: int
    window_connections: int
    window_errors: int
    latency_p50_us: float
    latency_p99_us: float
    latency_connections: int
    latency_errors: int


@dataclass(frozen=True, slots=True)
class UpdateCost:
    """One endpoint of Service `update` replaced, `changes` times at one size: the seconds from
    the manifest's rename to the first connection the new endpoint answered (reading the file
    included), how long the agent's syncs for it took, and what the datapath sent to the kernel
    for each (its own counter, usproxy_kernel_writes_total)."""

    services: int
    seconds: tuple[float | None, ...]  # None: the new endpoint did not answer within the timeout
    median_s: float | None
    kernel_writes: tuple[int, ...] | None  # None: this datapath counts nothing (the relay sends nothing)
    unit: str | None
    syncs: tuple[int, ...]  # syncs the agent ran for each change (kubeproxy_sync_proxy_rules_duration_seconds_count)
    sync_seconds: tuple[float, ...]  # how long they took, the agent's own histogram's sum
    sync_median_s: float


@dataclass(frozen=True, slots=True)
class Uniformity:
    """`connections` new connections to Service `uniform`, spread over its endpoints."""

    services: int
    endpoints: tuple[str, ...]
    counts: tuple[int, ...]  # per endpoint, as the client read them in the answers
    endpoint_counts: tuple[int, ...]  # per endpoint, as the endpoints counted their accepts
    connections: int
    errors: int
    chi_square: float
    df: int
    p_value: float


@dataclass(slots=True)
class ModeResult:
    """One mode of the tour: how it was run, and what it measured (filled as the visit goes)."""

    mode: str  # relay, iptables, ipvs, nftables, bpf
    offload: str  # the `usproxy run --offload` value
    available: bool
    why: str  # the datapath's own probe, or why the mode did not run
    datapath: str = ""  # the datapath name /services shows for its ServicePorts
    match_how: str = ""  # how a new connection finds its Service in this mode, in words
    served_by: dict[str, str] = field(default_factory=dict)  # measured Service -> /services datapath
    backend: str = ""  # iptables: iptables-nft or iptables-legacy, as the agent chose
    grow_seconds: dict[int, float] = field(default_factory=dict)  # size -> seconds until all were served
    loadavg: tuple[float, ...] = ()  # the machine's 1-minute load average as each size was measured
    match: list[MatchCost] = field(default_factory=list)
    update: list[UpdateCost] = field(default_factory=list)
    uniformity: Uniformity | None = None
    client_counts: dict[str, int] = field(default_factory=dict)  # "address:port" -> connections it answered, as the client saw
    client_errors: int = 0  # connections that failed, as the client saw
    endpoint_counts: dict[str, int] = field(default_factory=dict)  # "address:port" -> connections it accepted, its own count
    error: str = ""  # a runtime failure that ended this mode's visit early
    agent_log: str = ""


@dataclass(frozen=True, slots=True)
class Plot:
    file: str
    caption: str


def document(tour: dict[str, Any], modes: list[ModeResult], plots: list[Plot]) -> dict[str, Any]:
    return {"tour": tour, "modes": [_plain(m) for m in modes], "plots": [dataclasses.asdict(p) for p in plots]}


def _plain(m: ModeResult) -> dict[str, Any]:
    d = dataclasses.asdict(m)
    d["grow_seconds"] = {str(k): v for k, v in m.grow_seconds.items()}
    return d


def write(directory: Path, doc: dict[str, Any]) -> Path:
    path = directory / "results.json"
    tmp = directory / ".results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.rename(path)
    return path
