"""One mode's visit: the tour's Services served by `usproxy run --offload MODE`, measured.

In order, in fresh namespaces (usproxy/tour/network.py):
1. the endpoints start, the manifest holds the smallest size, the agent starts; the visit waits
   until /metrics says every ServicePort is served by the mode's datapath and the relay's
   listeners (every mode keeps them as the fallback) are all open, so the agent is idle;
2. uniformity: `uniform_count` connections to Service `uniform` (16 in flight), counted per
   endpoint in the answers, and by the endpoints themselves; chi-square against uniform;
3. per size, growing the same manifest in place (the agent applies the new Services as one
   change, as it would a real cluster's growth): the match cost of `a-first` and `z-last`
   (rounds of: new connections per second with `conc` in flight for `window` seconds, the best
   window kept, then
   `latency_count` connections one at a time for p50 and p99), then `changes` endpoint changes of
   Service `update` (its own small file rewritten), each timed from the file's rename to the first
   connection its new endpoint answered (a connection every 2 ms), with the agent's own sync time
   and its counter of what it sent to the kernel (usproxy_kernel_writes_total) read before and
   after its sync;
4. the agent stops; BPF programs and pins go with `usproxy run --cleanup`; the namespaces go.

For iptables the position of each measured Service's rule in KUBE-SERVICES is read from the
kernel (iptables-save), which is what a new connection walks before it matches.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usproxy.tour import manifests as m
from usproxy.tour.network import TourNetwork, nsexec, remove_bpf, shielded
from usproxy.tour.processes import Agent, Client, Endpoints
from usproxy.tour.results import MatchCost, ModeResult, Position, UpdateCost, Uniformity
from usproxy.tour.stats import chi_square, percentile

log = logging.getLogger(__name__)

GROW_TIMEOUT = 600.0  # seconds for a size's Services to be served
CHANGE_TIMEOUT = 30.0  # seconds for one endpoint change to take effect
CHANGE_GAP = 0.5  # seconds between changes: past the agent's --min-sync-period (0.25 s)
SETTLE = 1.0  # seconds over which the agent's CPU is read before measuring
QUIET = 0.05  # of a CPU: the agent counts as idle below it
CLK_TCK = os.sysconf("SC_CLK_TCK")

TARGET_PORT = {m.FIRST.ip: m.MATCH_PORT, m.LAST.ip: m.MATCH_PORT, m.UNIFORM.ip: m.UNIFORM_PORT,
               m.UPDATE.ip: m.UPDATE_PORT}
MATCH_HOW = {
    "relay": "the kernel's socket lookup finds the relay's listener on ClusterIP:port (a hash), the relay picks an "
             "endpoint and opens a second connection to it",
    "iptables": "nat OUTPUT jumps to KUBE-SERVICES, whose rules are tried one by one until one matches the "
                "ClusterIP and port; then the Service's chain picks an endpoint with -m statistic",
    "ipvs": "one hash lookup of the virtual server (ClusterIP:port) in IPVS, which picks a real server",
    "nftables": "one lookup of ClusterIP . protocol . port in the verdict map service-ips, then numgen random "
                "picks a slot",
    "bpf": "at connect() one hash-map lookup of ClusterIP:port and a random slot: the socket is connected to the "
           "endpoint itself, no packet is translated",
}


SYNC_COUNT = "kubeproxy_sync_proxy_rules_duration_seconds_count"


@dataclass(frozen=True, slots=True)
class _Change:
    """One endpoint change, as the client and the agent's counters saw it."""

    seconds: float | None  # manifest renamed -> first connection the new endpoint answered
    writes: int | None  # usproxy_kernel_writes_total's increase; None: the datapath counts nothing
    unit: str | None
    syncs: int  # syncs the agent ran for it
    sync_seconds: float  # their duration, the agent's own (kubeproxy_sync_proxy_rules_duration_seconds)


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to measure (the tour's --quick and full plans are in runner.py)."""

    sizes: tuple[int, ...]
    rounds: int  # match cost: rounds of (first, last), alternating which goes first
    window: float  # seconds of one connection-rate window (one per Service and round)
    conc: int  # connections in flight in that window
    latency_count: int  # connections one at a time per Service and round, for p50 and p99
    changes: int  # endpoint changes per size
    uniform_count: int  # connections of the uniformity test


def endpoint_specs() -> list[str]:
    return ([f"{ip}:{m.MATCH_PORT}" for ip in m.ENDPOINTS] + [f"{ip}:{m.UNIFORM_PORT}" for ip in m.ENDPOINTS]
            + [f"{ip}:{m.UPDATE_PORT}" for ip in m.UPDATE_ENDPOINTS])


class Visit:
    """One mode, run and measured; `after` (tests) is called with the visit while the agent
    still runs, once everything is measured."""

    def __init__(self, result: ModeResult, net: TourNetwork, plan: Plan, work: Path,
                 after: Callable[[Visit], None] | None = None, say: Callable[[str], None] = print) -> None:
        self.result, self.net, self.plan, self.work, self.after, self.say = result, net, plan, work, after, say
        self.manifest = work / f"services-{result.mode}"
        self.update_endpoint = m.UPDATE_ENDPOINTS[0]
        self.endpoints: Endpoints | None = None
        self.agent: Agent | None = None
        self.client: Client | None = None
        self.size = 0

    def run(self) -> None:
        try:
            self._start()
            self._uniformity()
            for n in self.plan.sizes:
                if n != self.size:
                    self._grow(n)
                self._match(n)
                self._updates(n)
            if self.endpoints is not None:
                self.result.endpoint_counts = self.endpoints.counts()
            if self.after is not None:
                self.after(self)
        finally:
            self.close()

    # -- set-up -----------------------------------------------------------------------------
    def _start(self) -> None:
        r = self.result
        self.net.build()
        self.endpoints = Endpoints(self.net.pods, endpoint_specs())
        self.size = self.plan.sizes[0]
        m.write(self.manifest, self.size, self.update_endpoint)
        log_path = self.work / f"agent-{r.mode}.log"
        r.agent_log = str(log_path)
        t0 = time.monotonic()
        self.agent = Agent(self.net.node, r.offload, self.manifest, self.net.cgroup, self.net.pin_root, log_path)
        r.grow_seconds[self.size] = round(self._wait_served(self.size, t0), 3)
        self.client = Client(self.net.node, self.net.cgroup)
        for svc in (m.FIRST, m.LAST, m.UPDATE):  # not `uniform`: only the uniformity test connects to it
            self._wait_answering(svc)
        rows = {row["servicePortName"]: row for row in self.agent.services()}
        r.served_by = {svc.key: str(rows.get(svc.key, {}).get("datapath", "absent"))
                       for svc in (m.FIRST, m.LAST, m.UNIFORM, m.UPDATE)}
        if r.mode == "iptables":
            r.backend = self._iptables_backend()
        self.say(f"  {r.mode}: {self.size} Services served in {r.grow_seconds[self.size]:.1f} s")

    def _wait_served(self, n: int, t0: float) -> float:
        """Every ServicePort on the mode's datapath, every relay listener open (the seconds from
        `t0` until then, returned), then the agent idle."""
        assert self.agent is not None
        self.agent.wait_placed(self.result.datapath, n, GROW_TIMEOUT)
        deadline = time.monotonic() + GROW_TIMEOUT
        while self._listeners() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} relay listeners not open after {GROW_TIMEOUT:.0f} s")
            time.sleep(0.2)
        served = time.monotonic() - t0
        self._wait_quiet()
        return served

    def _wait_quiet(self, timeout: float = 30.0) -> None:
        """Until the agent used under QUIET of a CPU over SETTLE seconds (what it does after a
        large sync, e.g. giving memory back, would otherwise share the CPU with the measurement),
        or `timeout`."""
        assert self.agent is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = _cpu_seconds(self.agent.proc.pid)
            time.sleep(SETTLE)
            if _cpu_seconds(self.agent.proc.pid) - before < QUIET * SETTLE:
                return

    def _listeners(self) -> int:
        out = nsexec(self.net.node, "ss", "-Htln", f"sport = :{m.SERVICE_PORT}").stdout
        return len(out.splitlines())

    def _wait_answering(self, svc: m.Measured, timeout: float = 60.0) -> None:
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while True:
            got = self._ask({"op": "sequential", "ip": svc.ip, "port": svc.port, "count": 1})
            if got["connections"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{svc.key} ({svc.ip}:{svc.port}) does not answer: {got['first_error']}")
            time.sleep(0.1)

    def _grow(self, n: int) -> None:
        t0 = time.monotonic()
        m.write_bulk(self.manifest, n)
        self.result.grow_seconds[n] = round(self._wait_served(n, t0), 3)
        self.size = n
        self.say(f"  {self.result.mode}: {n} Services served in {self.result.grow_seconds[n]:.1f} s")

    # -- the client, tallied ------------------------------------------------------------------
    def _ask(self, spec: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        return self._tally(spec, self.client.ask(spec))

    def _until(self, spec: dict[str, Any], change: Callable[[], float]) -> tuple[float, dict[str, Any]]:
        assert self.client is not None
        t, got = self.client.until(spec, change)
        return t, self._tally(spec, got)

    def _tally(self, spec: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
        """Every answered connection, by the endpoint that answered ("address:port"), and every
        error: the visit's record of what the client saw, which the endpoints' own counts meet."""
        target = TARGET_PORT[spec["ip"]]
        for ep, n in got.get("by_endpoint", {}).items():
            key = f"{ep}:{target}"
            self.result.client_counts[key] = self.result.client_counts.get(key, 0) + int(n)
        self.result.client_errors += int(got.get("errors", 0))
        return got

    # -- measurements -------------------------------------------------------------------------
    def _uniformity(self) -> None:
        assert self.client is not None and self.endpoints is not None
        specs = [f"{ip}:{m.UNIFORM_PORT}" for ip in m.ENDPOINTS]
        before = self.endpoints.counts()
        got = self._ask({"op": "count", "ip": m.UNIFORM.ip, "port": m.UNIFORM.port, "conc": 16,
                               "count": self.plan.uniform_count})
        after = self.endpoints.counts()
        counts = tuple(int(got["by_endpoint"].get(ip, 0)) for ip in m.ENDPOINTS)
        test = chi_square(counts)
        self.result.uniformity = Uniformity(
            self.size, m.ENDPOINTS, counts, tuple(after[s] - before[s] for s in specs), int(got["connections"]),
            int(got["errors"]), round(test.statistic, 4), test.df, test.p_value)
        self.say(f"  {self.result.mode}: uniformity of {got['connections']} connections: "
                 f"{'/'.join(map(str, counts))}, p = {test.p_value:.3f}")

    def _match(self, n: int) -> None:
        self.result.loadavg += (round(os.getloadavg()[0], 2),)
        self._rounds(n)

    def _rounds(self, n: int) -> None:
        """Rounds of (first, last) and (last, first) in turn, so a burst of load elsewhere on the
        machine falls on both; the rate is the best of the rounds' windows (other work on the
        machine only ever lowers a window's rate, as timeit takes the fastest run), the latency
        percentiles are over the connections of every round."""
        walked = self._rule_positions() if self.result.mode == "iptables" else {}
        both: tuple[tuple[Position, m.Measured], ...] = (("first", m.FIRST), ("last", m.LAST))
        rates: dict[Position, list[dict[str, Any]]] = {"first": [], "last": []}
        singles: dict[Position, list[dict[str, Any]]] = {"first": [], "last": []}
        assert self.client is not None
        p = self.plan
        for r in range(p.rounds):
            for position, svc in both if r % 2 == 0 else both[::-1]:
                rates[position].append(self._ask(
                    {"op": "window", "ip": svc.ip, "port": svc.port, "conc": p.conc, "seconds": p.window}))
                singles[position].append(self._ask(
                    {"op": "sequential", "ip": svc.ip, "port": svc.port, "count": p.latency_count}))
        for position, svc in both:
            self.result.match.append(self._match_cost(n, position, svc, walked.get(svc.ip), rates[position],
                                                      singles[position]))

    def _match_cost(self, n: int, position: Position, svc: m.Measured, walked: int | None,
                    rates: list[dict[str, Any]], singles: list[dict[str, Any]]) -> MatchCost:
        lat = [x for one in singles for x in one["latencies_us"]]
        cps = max(r["connections"] / r["seconds"] for r in rates)
        cost = MatchCost(n, position, svc.key, walked, round(cps, 1), self.plan.conc,
                         sum(int(r["connections"]) for r in rates), sum(int(r["errors"]) for r in rates),
                         round(percentile(lat, 50), 1), round(percentile(lat, 99), 1),
                         sum(int(o["connections"]) for o in singles), sum(int(o["errors"]) for o in singles))
        self.say(f"  {self.result.mode}: {n} Services, {position}: {cost.conns_per_s:.0f} conn/s, "
                 f"p50 {cost.latency_p50_us:.0f} us, p99 {cost.latency_p99_us:.0f} us"
                 + (f", rule {walked} of KUBE-SERVICES" if walked else ""))
        return cost

    def _updates(self, n: int) -> None:
        seconds: list[float | None] = []
        writes: list[int] = []
        syncs: list[int] = []
        sync_s: list[float] = []
        unit = None
        for _ in range(self.plan.changes):
            c = self._one_change(n)
            seconds.append(c.seconds)
            syncs.append(c.syncs)
            sync_s.append(c.sync_seconds)
            unit = c.unit
            if c.writes is not None:
                writes.append(c.writes)
            time.sleep(CHANGE_GAP)
        done = [s for s in seconds if s is not None]
        cost = UpdateCost(n, tuple(seconds), round(statistics.median(done), 4) if done else None,
                          tuple(writes) if unit is not None else None, unit, tuple(syncs), tuple(sync_s),
                          round(statistics.median(sync_s), 4))
        self.result.update.append(cost)
        sent = f", {statistics.median(writes):.0f} {unit} each" if writes and unit else ""
        took = f"{cost.median_s * 1000:.0f} ms" if cost.median_s is not None else "no effect seen"
        self.say(f"  {self.result.mode}: {n} Services, one endpoint change: {took}{sent}")

    def _one_change(self, n: int) -> _Change:
        assert self.client is not None and self.agent is not None
        new = m.UPDATE_ENDPOINTS[1] if self.update_endpoint == m.UPDATE_ENDPOINTS[0] else m.UPDATE_ENDPOINTS[0]
        before = self.agent.metrics()

        def change() -> float:
            t = time.monotonic()
            m.write_update(self.manifest, new)
            return t

        t_edit, got = self._until({"ip": m.UPDATE.ip, "port": m.UPDATE.port, "endpoint": new,
                                         "timeout": CHANGE_TIMEOUT, "interval": 0.002}, change)
        self.update_endpoint = new
        after = self._after_sync(before)
        def delta(name: str) -> float:
            return _sum(after, name) - _sum(before, name)

        units = [dict(labels).get("unit", "") for (name, labels) in after if name == "usproxy_kernel_writes_total"]
        unit = units[0] if units else None
        took = got["t"] - t_edit if got["t"] is not None else None
        return _Change(round(took, 4) if took is not None else None,
                       int(delta("usproxy_kernel_writes_total")) if unit else None, unit,
                       int(delta(SYNC_COUNT)), round(delta("kubeproxy_sync_proxy_rules_duration_seconds_sum"), 4))

    def _after_sync(self, before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                    timeout: float = CHANGE_TIMEOUT) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """/metrics once the sync that carried the change has ended (its count went up)."""
        assert self.agent is not None
        key = SYNC_COUNT
        deadline = time.monotonic() + timeout
        while True:
            now = self.agent.metrics()
            if _sum(now, key) > _sum(before, key) or time.monotonic() > deadline:
                time.sleep(0.2)  # a second sync asked for by the same change (offload window) ends too
                return self.agent.metrics()
            time.sleep(0.05)

    # -- the kernel's own view ---------------------------------------------------------------
    def _iptables_backend(self) -> str:
        for tool in ("iptables-nft-save", "iptables-legacy-save"):
            if ":KUBE-SERVICES" in nsexec(self.net.node, tool, "-t", "nat", check=False).stdout:
                return tool.removesuffix("-save")
        return ""

    def _rule_positions(self) -> dict[str, int]:
        """ClusterIP -> the position (1-based) of its rule in nat KUBE-SERVICES."""
        tool = f"{self.result.backend or 'iptables'}-save"
        rules = [ln for ln in nsexec(self.net.node, tool, "-t", "nat").stdout.splitlines()
                 if ln.startswith("-A KUBE-SERVICES ")]
        out = {}
        for i, rule in enumerate(rules, 1):
            for ip in (m.FIRST.ip, m.LAST.ip):
                if f"-d {ip}/32 " in rule and ip not in out:
                    out[ip] = i
        return out

    def close(self) -> None:
        """Stop what the visit started, in order; its namespaces go (the runner removes the rest)."""
        with shielded():
            self._close()

    def _close(self) -> None:
        for part in (self.client, self.agent):
            if part is not None:
                try:
                    part.close()
                except Exception as err:  # the rest must still go
                    log.warning("stopping %s: %s", type(part).__name__, err)
        if self.result.offload == "bpf":
            remove_bpf(self.net.node, self.net.cgroup, self.net.pin_root)
        if self.endpoints is not None:
            self.endpoints.close()
        self.net.teardown()


def _sum(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == name)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (every thread), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK
