"""`usproxy explain --scale N`: why, in numbers, at N Services, measured by the renderers and
tracers themselves.

For N Services generated like the input's (usproxy.explain.generator), each mode's own tracer
follows a pod's new connection to the last Service generated (the first of its ports), which
sorts last in every rule list, so a list walked in order is walked whole; then one endpoint is
added to that ServicePort and the two renderings are compared as `explain diff` does (lines of
the rendered rules changed, padding aside, and what kube-proxy sends: iptables-restore lines, nftables
operations, IPVS real servers and ipset entries, BPF map elements). Nothing is estimated: every
number is read off a rendering or a trace of the N Services. Each mode's wall time is measured
and printed beside its numbers (kube-proxy's and Cilium's own code is much faster than these
Python renderers; the time says what this run cost, not what a node spends).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from usproxy.explain import cost, diff, generator
from usproxy.explain.diff import View
from usproxy.explain.mode import Mode
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.model.types import format_hostport
from usproxy.util.table import render_table

MAX_SERVICES = 60_000  # 10.96.0.0/16 holds 65,534 ClusterIPs
SLOW_SECONDS = 30.0  # a mode slower than this is flagged in the output


@dataclass(frozen=True, slots=True)
class ModeScale:
    """One mode's numbers at N Services: the first packet's `rules` (mean over the paths,
    weighted by share) and `worst`, its `lookups`; `added`/`removed` rendered lines of one
    endpoint change; `sends`: what the proxier writes for it, in its own unit; `seconds`: wall
    time of this mode's tracing, rendering and diffing."""

    mode: str
    rules: Fraction
    worst: int
    lookups: Fraction
    added: int
    removed: int
    sends: str
    seconds: float


def last_port(ss: ServiceSet) -> FamilyPort:
    """The first ServicePort of the last Service, in its primary ClusterIP's family."""
    last = ss.ports[-1][0].name.service
    sp = next(sp for sp, _ in ss.ports if sp.name.service == last)
    (fp,) = (f for f in ss.family_ports(sp.cluster_ip.version) if f.name == sp.name)
    return fp


def unpadded(text: str) -> str:
    """`text` with each line's runs of blanks made one (diff.unpadded, line by line): how
    `explain diff` compares renderings."""
    return "\n".join(diff.unpadded(line) for line in text.splitlines())


def measure(ss: ServiceSet, mode: Mode, view: View) -> ModeScale:
    """One mode's numbers for the ServiceSet `ss` (already generated)."""
    start = time.perf_counter()
    fp = last_port(ss)
    rules, worst, lookups = cost.first_packet_of(ss, fp, mode)
    new = generator.with_endpoint_added(ss, fp.name)
    _, added, removed = diff.unified(view(ss, mode), view(new, mode), mode.name)  # padding aside
    sends = mode.sends(ss, new)
    return ModeScale(mode.name, rules, worst, lookups, added, removed, sends, time.perf_counter() - start)


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.1f}"


HEADER = ["MODE", "RULES WALKED", "LOOKUPS", "RENDERED LINES CHANGED", "ONE ENDPOINT ADDED WRITES", "MEASURED IN"]


def row(m: ModeScale) -> list[str]:
    """One mode's measurements as a row under HEADER."""
    walked = _num(m.rules) if m.rules == m.worst else f"{_num(m.rules)} (worst {m.worst})"
    return [m.mode, walked, _num(m.lookups), f"{m.added + m.removed} (+{m.added} -{m.removed})",
            m.sends, f"{m.seconds:.1f} s"]


def render(ss: ServiceSet, n: int, modes: Sequence[Mode], view: View) -> str:
    """The `--scale N` section: how the Services were generated, then one row per mode."""
    big = generator.generate(ss, n)
    fp = last_port(big)
    rows, notes = [], []
    for mode in modes:
        m = measure(big, mode, view)
        rows.append(row(m))
        if m.seconds > SLOW_SECONDS:
            notes.append(f"# {m.mode}: measuring took {m.seconds:.0f} s at {n} Services: this Python "
                         "renderer is slow at this size (the numbers above are still exact)")
    endpoints = sum(len(eps) for _, eps in big.ports)
    k = len(generator.templates(ss))
    head = [f"# Why, in numbers, at {n} Services generated like the input's {k} Service{'s' * (k != 1)} "
            f"(taken in turn: ports, endpoints, policies; {len(big.ports)} ServicePorts, {endpoints} "
            "endpoints; new ClusterIPs in 10.96.0.0/16, endpoints in 10.244.0.0/16)",
            f"# first packet: a pod's new connection to the last Service generated, {fp.name} at "
            f"{format_hostport(fp.cluster_ip, fp.sp.port)}/{fp.sp.protocol}, traced through each mode's rules",
            f"# one change: one endpoint added to {fp.name}; each mode's rules rendered before and after "
            "and compared as `explain diff` does",
            render_table(HEADER, rows)]
    notes[:0] = [mode.scale_note for mode in modes if mode.scale_note]
    return "\n".join(head + notes) + "\n"
