"""C17 (a, c): backend selection through the relay is uniform for `random`, exact for `roundRobin`,
and has no stale slots after an endpoint is replaced.

Fault class: selection statistics: cascaded-probability maths, rounding, modulo bias, and stale
slot arrays after churn. Variant (b), 1,000 endpoints × 200,000 draws, is done through the
selector in test_endpoint_selector.py, as the case allows.

Setup as in the case (be-1..be-5 at 10.244.n.30:8080; be-6 at 10.244.6.30 replaces be-3 halfway
through), with the policy set per Service by the usproxy.io/lb-policy annotation: one Service with
`random` (3 clients, each connection from a new source port) and one with `roundRobin` (one
sequential client) run side by side. Reductions: 6,000 random connections before and 6,000 after
the change instead of 30,000 each, so the per-endpoint tolerance is scaled with the standard
deviation: the case's 6,000 ± 300 of 30,000 is ±4.3 sd; here 1,200 ± 140 (±4.5 sd, so five
endpoints flake about 1 in 10^4.5); the chi-square test keeps p ≥ 0.001, with one independent
re-draw when a sample falls below (a correct relay: 1 in 10^6). Round robin: 1,000 sequential
connections per phase, counts differ by at most 1 (exact, no tolerance). Connections during the
second after T_upd must all succeed but are not counted; from T_upd + 1 s be-3 gets 0.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import chisquare

from tests.netns import Topology
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import NsPool, ask

pytestmark = pytest.mark.netns

RANDOM_VIP, RR_VIP = "10.96.120.120", "10.96.120.121"
N_RANDOM, N_RR = 6000, 1000
TOLERANCE = 140  # 4.5 sd of Binomial(6000, 1/5)


def be(n: int) -> str:
    return f"10.244.{n}.30"


def objects(members: list[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, vip, policy in (("spread", RANDOM_VIP, "random"), ("spread-rr", RR_VIP, "roundRobin")):
        s = svc(name, vip, [{"port": 80, "targetPort": 8080}], sessionAffinity="None")
        s["metadata"]["annotations"] = {"usproxy.io/lb-policy": policy}
        out += [s, slice_(name, [{"ip": be(n), "ready": True} for n in members], [{"port": 8080, "protocol": "TCP"}])]
    return out


def connections(pools: list[NsPool], vip: str, n: int) -> Counter[str]:
    """n connections to vip:80 split over the pools' netns (one thread each, sequential in each)."""
    share = [n // len(pools) + (i < n % len(pools)) for i in range(len(pools))]
    futures = [p.submit(sequential, vip, k) for p, k in zip(pools, share)]
    total: Counter[str] = Counter()
    for f in futures:
        total.update(f.result())
    return total


def sequential(vip: str, n: int) -> Counter[str]:
    return Counter(ask(vip, 80) for _ in range(n))


def check_random(draw: Callable[[], Counter[str]], members: list[int]) -> Counter[str]:
    """Per-endpoint tolerance on the first sample; chi-square p ≥ 0.001, with one re-draw."""
    got = draw()
    assert sum(got.values()) == N_RANDOM
    assert set(got) <= {f"be-{n}" for n in members}, got
    expected = N_RANDOM / len(members)
    assert all(abs(got[f"be-{n}"] - expected) <= TOLERANCE for n in members), got
    sample = got
    for _ in range(2):
        p = chisquare([sample[f"be-{n}"] for n in members]).pvalue
        if p >= 0.001:
            return got
        sample = draw()
    raise AssertionError(f"chi-square p = {p:.2g} twice: {got}, then {sample}")


def check_round_robin(got: Counter[str], members: list[int]) -> None:
    assert sum(got.values()) == N_RR
    assert set(got) == {f"be-{n}" for n in members}, got
    assert max(got.values()) - min(got.values()) <= 1, got


def test_uniform_random_exact_round_robin_and_churn(topology: Topology, backends: Backends, workdir: Path,
                                                    loop_name: str) -> None:
    for n in range(1, 7):
        backends.start(topology.add_host(f"be{n}", be(n)), "idsrv", f"be-{n}", be(n), "8080")
    pools = [NsPool(topology.add_host(f"cli{i}", f"10.244.9.{10 + i}"), 1) for i in range(3)]
    rr_pool = NsPool(topology.add_host("clirr", "10.244.9.20"), 1)
    m = Manifests(workdir)
    before, after = [1, 2, 3, 4, 5], [1, 2, 4, 5, 6]
    m.write(*objects(before))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        rr = rr_pool.submit(sequential, RR_VIP, N_RR)
        check_random(lambda: connections(pools, RANDOM_VIP, N_RANDOM), before)
        check_round_robin(rr.result(), before)

        t_upd = m.write(*objects(after))
        seen: Counter[str] = Counter()
        while time.monotonic() < t_upd + 1.0:  # every connection across the change succeeds
            seen.update(connections(pools, RANDOM_VIP, 30))
        assert set(seen) <= {f"be-{n}" for n in range(1, 7)}

        rr = rr_pool.submit(sequential, RR_VIP, N_RR)
        got = check_random(lambda: connections(pools, RANDOM_VIP, N_RANDOM), after)
        assert got["be-3"] == 0
        check_round_robin(rr.result(), after)
    finally:
        for p in (*pools, rr_pool):
            p.shutdown(cancel_futures=True)
        assert agent.stop() == 0

