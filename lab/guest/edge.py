"""The edge machine (1 vCPU, 256 MiB by default; `vm.sh edge-256 --memory 128` for the smaller one):
100 Services from a static manifest (half TCP, half UDP, two pods each), offload on (`--offload
nftables` unless `vm.sh --offload` says otherwise: with `auto` the BPF socket LB's preallocated LRU
maps alone exhaust 256 MiB, docs/lab.md), then a soak
of `duration_s` with an endpoint change every second (one Service's second endpoint flips to not
ready, the one before flips back: a rewritten manifest each time) and new connections through
every Service (four a second, round robin, so each Service is reached every 25 s; and a sweep of
all 100 before and after).

Reported: the agent's RSS at start (Services listed), idle (offloaded, before the soak) and peak
(sampled every second), its CPU over the soak, every probe that failed, and whether the kernel's
OOM killer ran (dmesg). It passes when no probe failed, the agent lived through it, nothing was
OOM-killed and the ServicePorts ended in the kernel.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import manifests
import node
import traffic
from agent import Agent, memory_state
from node import say
from result import BPF_CGROUP, PARAMS, WORK

SERVICES = 100
PODS = 4


def sweep(n: int) -> dict[str, int]:
    """One new connection (or UDP socket) to each of the first n Services; failures by Service."""
    failed: dict[str, int] = {}
    for i in range(n):
        proto = "TCP" if i % 2 == 0 else "UDP"
        who = traffic.probe(manifests.edge_ip(i), 80, proto)
        if who.startswith("error"):
            failed[f"s{i}"] = failed.get(f"s{i}", 0) + 1
    return failed


def oom_lines() -> list[str]:
    try:
        out = node.sh("dmesg", check=False).stdout
    except subprocess.TimeoutExpired:  # a thrashing machine: the kernel's own counter says it
        count = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines()).get("oom_kill", "0")
        return [] if count == "0" else [f"/proc/vmstat oom_kill {count} (dmesg did not answer)"]
    return [line for line in out.splitlines() if "Out of memory" in line or "oom-kill" in line or "Killed process" in line]


def run(res: Any) -> None:
    duration = float(PARAMS["duration_s"] or 60)
    res.data["check"] = __import__("proofs").check_json()
    pods = node.build(PODS)
    node.start_servers(PODS, [manifests.TCP_PORT], [manifests.UDP_PORT])
    services = WORK / "services"
    services.mkdir(parents=True)
    manifest = services / "services.yaml"
    manifests.edge(manifest, SERVICES, pods)
    BPF_CGROUP.mkdir(exist_ok=True)
    mem_before = node_mem()
    res.data["offload"] = PARAMS["offload"]
    try:
        agent = Agent(services, "--offload", PARAMS["offload"], "--offload-after", "5", "--bpf-cgroup", str(BPF_CGROUP))
    except RuntimeError as err:
        res.fail(f"{res.data['memory_kib'] // 1024} MiB usable is too little: {err}")
        return
    fig: dict[str, Any] = res.data["figures"]
    fig["agent_start_s"] = agent.start_s
    fig["rss_start_kib"] = agent.rss_kib()
    fig["mem_available_start_kib"] = node_mem()
    try:
        soak(res, agent, manifest, pods, duration)
    except OSError as err:  # the admin endpoint or a probe gave up: say what the memory was doing
        res.fail(f"{res.data['memory_kib'] // 1024} MiB usable is too little: the agent stopped answering "
                 f"({type(err).__name__}: {err}) with {memory_state()}")
    finally:
        fig["oom_lines"] = oom_lines()
        alive = agent.proc.poll() is None
        res.expect(alive, f"the agent died during the soak (exit {agent.proc.returncode}); "
                          f"log tail: {agent.log.read_text()[-600:]}")
        res.expect(not fig["oom_lines"], f"the OOM killer ran: {fig['oom_lines'][:3]}")
        if alive:
            res.expect(agent.stop() in (0, -15), "agent did not exit cleanly on SIGTERM")
        fig["mem_available_before_agent_kib"] = mem_before


def node_mem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def soak(res: Any, agent: Agent, manifest: Path, pods: list[str], duration: float) -> None:
    fig = res.data["figures"]
    start = time.monotonic()
    placed = wait_offloaded(agent, 240)
    fig["offload_all_s"] = round(time.monotonic() - start, 1)
    fig["offloaded_before_soak"] = placed
    time.sleep(5)
    fig["rss_idle_kib"] = agent.rss_kib()
    fig["mem_available_idle_kib"] = node_mem()
    failed_before = sweep(SERVICES)
    say(f"soak of {duration:.0f} s: an endpoint change every second, 4 connections a second")
    cpu0, t0 = agent.cpu_s(), time.monotonic()
    peak, probes, failures, changes = fig["rss_idle_kib"], 0, [], 0
    k = 0
    while time.monotonic() - t0 < duration:
        tick = time.monotonic()
        manifests.edge(manifest, SERVICES, pods, flipped=k % SERVICES)
        changes += 1
        for j in range(4):
            i = (4 * k + j) % SERVICES
            who = traffic.probe(manifests.edge_ip(i), 80, "TCP" if i % 2 == 0 else "UDP")
            probes += 1
            if who.startswith("error"):
                failures.append(f"t={tick - t0:.0f}s s{i}: {who}")
        if agent.proc.poll() is not None:
            break
        peak = max(peak, agent.rss_kib())
        if k % 60 == 0:
            say(f"soak {tick - t0:4.0f} s: rss {agent.rss_kib() // 1024} MiB, {probes} probes, {len(failures)} failed")
        k += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    soaked = time.monotonic() - t0
    if agent.proc.poll() is None:
        fig["cpu_soak_s"] = round(agent.cpu_s() - cpu0, 1)
        fig["cpu_soak_percent"] = round(100 * fig["cpu_soak_s"] / soaked, 1)
        failed_after = sweep(SERVICES)
        fig["datapaths_after"] = count(agent.datapaths())
    else:
        failed_after = {"agent": 1}
    fig["rss_peak_kib"] = peak
    res.data["soak"] = {"duration_s": round(soaked, 1), "endpoint_changes": changes, "probes": probes,
                        "probe_failures": failures[:20], "probe_failure_count": len(failures),
                        "sweep_failures_before": failed_before, "sweep_failures_after": failed_after}
    res.data["datapaths"] = fig.get("datapaths_after", {})
    res.expect(not failures, f"{len(failures)} of {probes} soak connections failed: {failures[:5]}")
    res.expect(not failed_before and not failed_after,
               f"sweeps of all {SERVICES} Services failed: before {failed_before}, after {failed_after}")
    res.expect(not {"userspace", "none"} & set(placed), f"not every ServicePort was offloaded before the soak: {placed}")


def count(datapaths: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in datapaths.values():
        out[d] = out.get(d, 0) + 1
    return out


def wait_offloaded(agent: Agent, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    now: dict[str, int] = {}
    while time.monotonic() < deadline:
        now = count(agent.datapaths())
        if now and not {"userspace", "none"} & set(now):  # "none": not synced yet
            break
        time.sleep(2)
    return now
