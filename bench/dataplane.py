"""Data-plane measurements: every contender, the same client, interleaved rounds, medians of ratios.

Per round the contender order rotates, and each metric runs for every contender before the next
metric, so drift from other load on the machine hits all contenders alike. Ratios are taken
within a round (contender ÷ baseline of that round), then the median over rounds is reported.
The proxy's CPU is read from /proc at the edges of the client's measurement window.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.contenders import Contender, Ctx
from bench.procs import cpu_seconds, run_json

GiB = 1 << 30


@dataclass(frozen=True)
class Plan:
    rounds: int
    bulk_bytes: int
    duration: float
    warmup: float = 0.4
    rr_conc: tuple[int, ...] = (1, 16, 64)
    conn_conc: int = 64
    udp_sizes: tuple[int, ...] = (64, 1400)
    udp_conc: int = 16
    latency_fraction: float = 0.5
    latency_conc: int = 16


Samples = dict[str, dict[str, dict[int, float]]]  # metric -> contender -> round -> value


class DataPlane:
    def __init__(self, ctx: Ctx, contenders: list[Contender], plan: Plan, log: Callable[[str], None]) -> None:
        self.ctx, self.plan, self.log = ctx, plan, log
        self.contenders = [c for c in contenders if c.available]
        self.samples: Samples = {}
        self.cpu: Samples = {}  # metric -> contender -> proxy CPU seconds per unit, per round
        self.checksums: dict[str, bool | None] = {}
        self.capacity: dict[str, float] = {}  # rr c=16 of the current round, for the latency load
        self.round = 0
        self.headline = "bulk_gbps"  # the metric the per-round log line shows

    # -- helpers -----------------------------------------------------------------------------------
    def _client(self, spec: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        return run_json(self.ctx.procs, self.ctx.topo.client, "bench.clients", spec, timeout)

    def _record(self, table: Samples, metric: str, c: Contender, value: float | None) -> None:
        if value is not None:
            table.setdefault(metric, {}).setdefault(c.name, {})[self.round] = value

    def _cpu(self, c: Contender) -> float | None:
        pids = c.pids()
        if not pids:
            return None
        total = 0.0
        for pid in pids:
            try:
                total += cpu_seconds(pid)
            except OSError:
                pass
        return total

    def _windowed(self, c: Contender, spec: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
        """Run a windowed client; returns its result and the proxy's CPU seconds inside the window."""
        now = time.monotonic()
        start = now + 0.3 + self.plan.warmup  # the client process starts in ~0.2 s
        end = start + self.plan.duration
        spec = dict(spec, target=c.target, start=start, end=end)

        marks: list[float | None] = []

        def sample() -> None:
            time.sleep(max(0.0, start - time.monotonic()))
            marks.append(self._cpu(c))
            time.sleep(max(0.0, end - time.monotonic()))
            marks.append(self._cpu(c))

        th = threading.Thread(target=sample)
        th.start()
        result = self._client(spec)
        th.join()
        cpu = None if None in marks else marks[1] - marks[0]  # type: ignore[operator]
        return result, cpu

    # -- metrics -------------------------------------------------------------------------------------
    def verify(self) -> None:
        """The checksummed 1 GiB transfer, once per contender (not timed)."""
        for c in self.contenders:
            r = self._client({"op": "bulk", "target": c.target, "bytes": self.plan.bulk_bytes, "checksum": True})
            self.checksums[c.name] = bool(r["checksum_ok"])
            self.log(f"  checksum {c.name}: {'ok' if r['checksum_ok'] else 'MISMATCH'}")

    def bulk(self, c: Contender) -> None:
        before = self._cpu(c)
        r = self._client({"op": "bulk", "target": c.target, "bytes": self.plan.bulk_bytes})
        after = self._cpu(c)
        self._record(self.samples, "bulk_gbps", c, r["bytes"] / r["seconds"] / 1e9)
        if before is not None and after is not None:
            self._record(self.cpu, "bulk_cpu_s_per_gib", c, (after - before) / (r["bytes"] / GiB))

    def rr(self, c: Contender, conc: int) -> None:
        r, cpu = self._windowed(c, {"op": "rr", "conc": conc})
        rate = r["requests"] / r["seconds"]
        self._record(self.samples, f"rr_c{conc}_rps", c, rate)
        if conc == 16:
            self.capacity[c.name] = rate
        if cpu is not None and r["requests"]:
            self._record(self.cpu, f"rr_c{conc}_cpu_s_per_10k", c, cpu / (r["requests"] / 1e4))

    def conn(self, c: Contender) -> None:
        r, cpu = self._windowed(c, {"op": "conn", "conc": self.plan.conn_conc, "sources": self.ctx.topo.sources,
                                    "procs": 2})
        self._record(self.samples, "conn_cps", c, r["conns"] / r["seconds"])
        self._record(self.samples, "conn_errors", c, float(r["errors"]))
        if cpu is not None and r["conns"]:
            self._record(self.cpu, "conn_cpu_s_per_10k", c, cpu / (r["conns"] / 1e4))

    def latency(self, c: Contender) -> None:
        cap = self.capacity.get(c.name)
        if not cap:
            return
        rate = cap * self.plan.latency_fraction
        r, _ = self._windowed(c, {"op": "latency", "rate": rate, "conc": self.plan.latency_conc})
        lats = r["lats_us"]
        self._record(self.samples, "lat_p50_us", c, lats.get("p50"))
        self._record(self.samples, "lat_p99_us", c, lats.get("p99"))
        self._record(self.samples, "lat_rate_rps", c, rate)

    def udp(self, c: Contender, size: int) -> None:
        if not c.udp:
            return
        r, cpu = self._windowed(c, {"op": "udp", "size": size, "conc": self.plan.udp_conc})
        self._record(self.samples, f"udp_{size}_rps", c, r["requests"] / r["seconds"])
        if cpu is not None and r["requests"]:
            self._record(self.cpu, f"udp_{size}_cpu_s_per_10k", c, cpu / (r["requests"] / 1e4))

    def steps(self) -> list[tuple[str, Callable[[Contender], None]]]:
        p = self.plan
        out: list[tuple[str, Callable[[Contender], None]]] = [("bulk", self.bulk)]
        out += [(f"rr c={k}", functools.partial(self.rr, conc=k)) for k in p.rr_conc]
        out += [("conn", self.conn), ("latency", self.latency)]
        out += [(f"udp {s} B", functools.partial(self.udp, size=s)) for s in p.udp_sizes]
        return out

    def run(self) -> None:
        self.verify()
        n = len(self.contenders)
        for rnd in range(self.plan.rounds):
            order = self.contenders[rnd % n:] + self.contenders[:rnd % n]
            self.capacity.clear()
            self.round = rnd
            t0 = time.monotonic()
            for label, step in self.steps():
                for c in order:
                    try:
                        step(c)
                    except (RuntimeError, TimeoutError, KeyError) as err:
                        self.log(f"  round {rnd + 1} {label} {c.name}: failed: {err}")
            self.log(f"  round {rnd + 1}/{self.plan.rounds} done in {time.monotonic() - t0:.0f}s "
                     + " ".join(f"{c.name}:{self.headline}={self.samples.get(self.headline, {}).get(c.name, {}).get(rnd, 0):.2f}"
                                for c in order))

    # -- summary --------------------------------------------------------------------------------------
    def ratios(self, baseline: str) -> dict[str, dict[str, float]]:
        """metric -> contender -> median over rounds of (contender ÷ baseline in that round)."""
        out: dict[str, dict[str, float]] = {}
        for metric, per in self.samples.items():
            base = per.get(baseline)
            if not base:
                continue
            for name, vals in per.items():
                rs = [v / base[r] for r, v in vals.items() if base.get(r)]
                if rs and name != baseline:
                    out.setdefault(metric, {})[name] = statistics.median(rs)
        return out

    def summary(self) -> dict[str, Any]:
        def lists(t: Samples) -> dict[str, dict[str, list[float]]]:
            return {m: {c: [v[r] for r in sorted(v)] for c, v in per.items()} for m, per in t.items()}

        med = {m: {c: statistics.median(v) for c, v in per.items()} for m, per in lists(self.samples).items()}
        cpu = {m: {c: statistics.median(v) for c, v in per.items()} for m, per in lists(self.cpu).items()}
        return {"plan": self.plan.__dict__, "contenders": [c.name for c in self.contenders],
                "median": med, "cpu": cpu, "samples": lists(self.samples), "cpu_samples": lists(self.cpu),
                "ratio_vs_direct": self.ratios("direct"),
                "ratio_vs_direct-routed": self.ratios("direct-routed"), "ratio_vs_haproxy": self.ratios("haproxy"),
                "ratio_vs_relay": self.ratios("relay"), "checksum_ok": self.checksums}
