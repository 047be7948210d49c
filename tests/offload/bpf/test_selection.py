"""Endpoint selection in the kernel: ClientIP affinity (C15, C16) and distribution (C17).

Affinity in the socket LB is per client network namespace (as Cilium's
lb4_affinity_backend_id_by_netns): each client netns here stands for one client IP. Expiry is
checked by ageing an entry in the pinned map rather than by waiting, so no test depends on timing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from scipy.stats import chisquare

from tests.offload.bpf.builders import ep, spn, state
from tests.offload.bpf.conftest import Env
from tests.netns import nsexec
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.layout import AffinityEntry

pytestmark = pytest.mark.netns

STICKY = spn("sticky")
SPREAD = spn("spread")
SPREAD_U = spn("spread", "u", "UDP")
VIP = "10.96.110.110"


def _affinity_fd(env: Env) -> int:
    return bpf.obj_get(str(env.dp.pins.maps / "usp_affinity"))


def _set_affinity(env: Env, entry: AffinityEntry) -> None:
    fd = _affinity_fd(env)
    try:
        bpf.map_update(fd, entry.pack_key(), entry.pack_val())
    finally:
        os.close(fd)


def _entries(env: Env) -> list[AffinityEntry]:
    fd = _affinity_fd(env)
    try:
        return [AffinityEntry.unpack(k, v) for k, v in bpf.map_items(fd, 16, 16)]
    finally:
        os.close(fd)


def _backend_id(env: Env, addr: str) -> int:
    for line in env.dp.dump().splitlines():
        if line.strip().startswith("slot") and line.endswith(f" {addr}:8080"):
            return int(line.split()[4])
    raise AssertionError(f"{addr} not installed:\n{env.dp.dump()}")


def _sticky(env: Env, eps: list[str], timeout: int = 5) -> dict[Any, Any]:
    return {STICKY: state(STICKY, VIP, 80, [ep(a) for a in eps], session_affinity="ClientIP",
                          affinity_timeout=timeout)}


async def test_client_ip_affinity(bpf_env: Env) -> None:
    addrs = ["10.244.1.20", "10.244.2.20", "10.244.3.20"]
    for i, a in enumerate(addrs):
        bpf_env.server(f"be-{'abc'[i]}", a, 8080)
    await bpf_env.dp.apply(_sticky(bpf_env, addrs))
    cli = bpf_env.client_ns("cli0", "10.244.9.10")

    first = bpf_env.run(cli, "tcp", VIP, 80, 30)["names"]
    assert len(first) == 1 and sum(first.values()) == 30  # C15 (1)
    [mine] = _entries(bpf_env)

    # other clients: each sticky, and together not all on one endpoint (C15 (4))
    chosen = set()
    for n in range(1, 12):
        names = bpf_env.run(bpf_env.client_ns(f"cli{n}", f"10.244.9.{10 + n}"), "tcp", VIP, 80, 4)["names"]
        assert len(names) == 1
        chosen |= set(names)
    assert len(chosen) >= 2

    # a live entry decides: point it at be-c, and be-c it is
    be_c = _backend_id(bpf_env, addrs[2])
    _set_affinity(bpf_env, AffinityEntry(mine.client, mine.svc_id, time.monotonic_ns(), be_c))
    assert bpf_env.run(cli, "tcp", VIP, 80, 10)["names"] == {"be-c": 10}

    # an expired entry does not: each connect after ageing picks afresh (C15 (3))
    landed = 0
    for _ in range(12):
        old = time.monotonic_ns() - 6 * 10**9
        _set_affinity(bpf_env, AffinityEntry(mine.client, mine.svc_id, old, be_c))
        landed += bpf_env.run(cli, "tcp", VIP, 80, 1)["names"].get("be-c", 0)
        [fresh] = [e for e in _entries(bpf_env) if e.client == mine.client]
        assert time.monotonic_ns() - fresh.last_used < 5 * 10**9  # re-created at this connect
    assert landed < 12


async def test_affinity_follows_endpoint_removal_and_spec_changes(bpf_env: Env) -> None:
    addrs = ["10.244.1.21", "10.244.2.21", "10.244.3.21"]
    for i, a in enumerate(addrs):
        bpf_env.server(f"be-{'abc'[i]}", a, 8080)
    await bpf_env.dp.apply(_sticky(bpf_env, addrs, timeout=10800))
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    [x] = bpf_env.run(cli, "tcp", VIP, 80, 5)["names"]
    x_id = _backend_id(bpf_env, addrs["abc".index(x[-1])])

    rest = [a for i, a in enumerate(addrs) if "abc"[i] != x[-1]]
    await bpf_env.dp.apply(_sticky(bpf_env, rest, timeout=10800))
    assert all(e.backend_id != x_id for e in _entries(bpf_env))  # C16 (3): purged
    after = bpf_env.run(cli, "tcp", VIP, 80, 20)["names"]
    assert len(after) == 1 and x not in after  # sticky to a new endpoint

    await bpf_env.dp.apply(_sticky(bpf_env, rest, timeout=2))
    assert "timeout=2s" in bpf_env.dp.dump()  # C15 (5): the new timeout is what the program reads

    await bpf_env.dp.apply({STICKY: state(STICKY, VIP, 80, [ep(a) for a in rest])})
    assert _entries(bpf_env) == []  # affinity off: its entries go
    spread = bpf_env.run(cli, "tcp", VIP, 80, 60)["names"]
    assert len(spread) == 2


async def test_random_selection_is_uniform_and_follows_churn(bpf_env: Env) -> None:
    addrs = [f"10.244.{n}.30" for n in range(1, 7)]
    for n, a in enumerate(addrs, 1):
        bpf_env.server(f"be-{n}", a, 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({SPREAD: state(SPREAD, "10.96.120.120", 80, [ep(a) for a in addrs[:5]],
                                          lb_policy="random")})

    counts = bpf_env.run(cli, "tcp", "10.96.120.120", 80, 3000)["names"]
    assert sorted(counts) == [f"be-{n}" for n in range(1, 6)]
    assert all(500 <= c <= 700 for c in counts.values()), counts
    assert chisquare(list(counts.values())).pvalue >= 0.001

    # C17 (c): be-3 replaced by be-6
    await bpf_env.dp.apply({SPREAD: state(SPREAD, "10.96.120.120", 80,
                                          [ep(a) for a in addrs if a != "10.244.3.30"], lb_policy="random")})
    counts = bpf_env.run(cli, "tcp", "10.96.120.120", 80, 3000)["names"]
    assert "be-3" not in counts
    assert 0.15 <= counts["be-6"] / 3000 <= 0.25, counts


async def test_round_robin_counts_differ_by_at_most_one(bpf_env: Env) -> None:
    addrs = [f"10.244.{n}.31" for n in range(1, 6)]
    for n, a in enumerate(addrs, 1):
        bpf_env.server(f"be-{n}", a, 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({SPREAD: state(SPREAD, "10.96.120.121", 80, [ep(a) for a in addrs],
                                          lb_policy="roundRobin")})

    counts = bpf_env.run(cli, "tcp", "10.96.120.121", 80, 1003)["names"]

    assert len(counts) == 5 and max(counts.values()) - min(counts.values()) <= 1, counts


async def test_thousand_endpoints_udp_draws(bpf_env: Env) -> None:
    eps = [ep(f"10.244.{200 + i // 256}.{i % 256}", 8081) for i in range(1000)]
    await bpf_env.dp.apply({SPREAD_U: state(SPREAD_U, "10.96.120.120", 81, eps)})
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    # the draw happens at sendmsg, before routing; the datagrams themselves go nowhere
    nsexec(cli, "ip", "route", "add", "blackhole", "10.244.200.0/22")

    out = bpf_env.run(cli, "udpsend", "10.96.120.120", 81, 200_000)

    assert sum(out["errors"].values()) == 200_000 and len(out["errors"]) == 1
    counts = bpf_env.dp.selected(SPREAD_U)
    assert len(counts) == 1000 and sum(counts.values()) == 200_000
    assert min(counts.values()) >= 120 and max(counts.values()) <= 290, (min(counts.values()), max(counts.values()))
    assert chisquare(list(counts.values())).pvalue >= 0.001
    assert "count=1000" in bpf_env.dp.dump()  # the modulus is the current count
