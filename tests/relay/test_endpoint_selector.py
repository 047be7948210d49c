"""EndpointSelector, without sockets: selection statistics and affinity state (C15, C16, C17 (b)).

Fault classes: selection statistics (cascaded-probability maths, rounding, modulo bias, starving
the highest-indexed endpoints, stale slot arrays after churn) and affinity state lifecycle (units
and refresh of the timeout, what invalidates a pin, following spec changes, no unbounded growth).

C17 (b) is done through the selector as the case allows: 1,000 endpoints, 200,000 random draws;
each endpoint gets between 120 and 290 and a chi-square goodness-of-fit test gives p ≥ 0.001.
The chi-square rule fails a correct selector once in 1,000 runs by construction, so a sample with
p < 0.001 is drawn again and the test fails only if the second independent sample also has
p < 0.001 (a correct selector: 1 in 10^6; any real bias fails both). Affinity is tested with an
injected clock, so its timing is exact here (the relay tests check it within ±1 s).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable

import pytest
from scipy.stats import chisquare

from usproxy.model.endpoint import Endpoint
from usproxy.relay.endpoint_selector import FAIL_BACKOFF, MAX_PINS, EndpointSelector
from usproxy.model.service_port import LBPolicy


def endpoints(n: int, base: str = "10.244.200.0", port: int = 8080) -> tuple[Endpoint, ...]:
    start = ipaddress.ip_address(base)
    return tuple(Endpoint(start + i, port) for i in range(n))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def selector(eps: tuple[Endpoint, ...], policy: LBPolicy = "roundRobin", affinity: str = "None",
             timeout: float = 10800.0, clock: Callable[[], float] | None = None) -> EndpointSelector:
    sel = EndpointSelector(clock=clock or Clock())
    sel.update(eps, policy, affinity, timeout)  # type: ignore[arg-type]
    return sel


def uniform_p(draw: Callable[[], list[int]]) -> float:
    """Chi-square p of `draw()`; one independent re-draw if the first is below 0.001 (see above)."""
    p = float(chisquare(draw()).pvalue)
    return p if p >= 0.001 else float(chisquare(draw()).pvalue)


def counts(sel: EndpointSelector, eps: tuple[Endpoint, ...], draws: int) -> list[int]:
    got = Counter(sel.pick(f"10.244.9.{i % 200}") for i in range(draws))
    return [got[e] for e in eps]


def test_random_1000_endpoints_200000_draws() -> None:
    eps = endpoints(1000)
    sel = selector(eps, "random")
    samples: list[list[int]] = []

    def draw() -> list[int]:
        samples.append(counts(sel, eps, 200_000))
        return samples[-1]

    assert uniform_p(draw) >= 0.001
    first = samples[0]
    assert sum(first) == 200_000
    assert 120 <= min(first) and max(first) <= 290, (min(first), max(first))
    assert min(first[-10:]) >= 120  # the highest-indexed endpoints are not starved


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 1000])
def test_round_robin_is_exact(n: int) -> None:
    eps = endpoints(n)
    sel = selector(eps)
    got = counts(sel, eps, 10 * n + n // 2)
    assert max(got) - min(got) <= 1
    order = [sel.pick("c") for _ in range(n)]
    k = eps.index(order[0])
    assert order == list(eps[k:] + eps[:k])  # one full turn visits every endpoint once, in order


def test_round_robin_after_churn_has_no_stale_slots() -> None:
    eps = endpoints(5)
    sel = selector(eps)
    counts(sel, eps, 13)
    be6 = Endpoint(ipaddress.ip_address("10.244.6.30"), 8080)
    after = eps[:2] + (be6,) + eps[3:]
    sel.update(after, "roundRobin", "None", 10800.0)
    got = Counter(sel.pick("c") for _ in range(5000))
    assert got[eps[2]] == 0
    assert set(got.values()) == {1000}


def test_random_after_churn() -> None:
    """C17 (c) on the selector: the replacement gets 1/5 (chi-square), the removed one nothing."""
    eps = endpoints(5)
    sel = selector(eps, "random")
    counts(sel, eps, 30_000)
    be6 = Endpoint(ipaddress.ip_address("10.244.6.30"), 8080)
    after = eps[:2] + (be6,) + eps[3:]
    sel.update(after, "random", "None", 10800.0)
    samples: list[list[int]] = []

    def draw() -> list[int]:
        got = Counter(sel.pick("c") for _ in range(30_000))
        assert got[eps[2]] == 0
        samples.append([got[e] for e in after])
        return samples[-1]

    assert uniform_p(draw) >= 0.001
    # ±5% of 1/5 as in the case: 6,000 ± 300 is 4.3 standard deviations.
    assert abs(samples[0][2] - 6000) <= 300


def test_least_connections_prefers_idle_endpoints() -> None:
    eps = endpoints(3)
    sel = selector(eps, "leastConnections")
    for _ in range(3):
        sel.opened(eps[0])
    sel.opened(eps[1])
    assert sel.pick("c") == eps[2]
    sel.opened(eps[2])
    assert sel.pick("c") in (eps[1], eps[2])
    for _ in range(3):
        sel.closed(eps[0])
    assert sel.pick("c") == eps[0]


def test_affinity_expires_exactly_timeout_after_the_last_new_connection() -> None:
    clock = Clock()
    eps = endpoints(3)
    sel = selector(eps, affinity="ClientIP", timeout=5.0, clock=clock)
    x = sel.pick("10.244.9.10")
    for _ in range(10):  # every 3 s: each pick refreshes the timer, so 30 s stay on x
        clock.now += 3.0
        assert sel.pick("10.244.9.10") == x
    clock.now += 5.0  # exactly timeout after the last pick: still pinned
    assert sel.pick("10.244.9.10") == x
    clock.now += 5.001
    assert sel.pick("10.244.9.10") != x  # expired: round robin moves on
    assert sel.pins() == {"10.244.9.10": sel.pick("10.244.9.10")}


def test_affinity_timeout_change_applies_to_existing_pins() -> None:
    clock = Clock()
    eps = endpoints(3)
    sel = selector(eps, affinity="ClientIP", timeout=5.0, clock=clock)
    x = sel.pick("c")
    sel.update(eps, "roundRobin", "ClientIP", 2.0)
    clock.now += 2.5
    assert sel.pick("c") != x


def test_affinity_failure_removal_rebuild_and_spec_changes() -> None:
    clock = Clock()
    eps = endpoints(3)
    sel = selector(eps, affinity="ClientIP", clock=clock)
    x = sel.pick("a")
    assert x is not None
    sel.failed(x)
    y = sel.pick("a", exclude=[x])
    assert y != x and all(sel.pick("a") == y for _ in range(20))
    # A pin to an endpoint that is removed is purged; pins to endpoints that remain survive.
    clock.now += FAIL_BACKOFF + 1
    others = {f"c{i}": sel.pick(f"c{i}") for i in range(6)}
    assert y in others.values()
    sel.update(tuple(e for e in eps if e != y), "roundRobin", "ClientIP", 10800.0)
    assert y not in sel.pins().values()
    for c, e in others.items():
        assert sel.pick(c) == e if e != y else sel.pick(c) != y
    # Scale to 0 and back to new addresses: affinity is enforced again.
    sel.update((), "roundRobin", "ClientIP", 10800.0)
    assert sel.pick("a") is None
    fresh = endpoints(3, base="10.244.1.22")
    sel.update(fresh, "roundRobin", "ClientIP", 10800.0)
    first = sel.pick("a")
    assert first in fresh and all(sel.pick("a") == first for _ in range(50))
    # None spreads evenly; back to ClientIP is sticky at once.
    sel.update(fresh, "roundRobin", "None", 10800.0)
    assert sorted(Counter(sel.pick("a") for _ in range(300)).values()) == [100, 100, 100]
    sel.update(fresh, "roundRobin", "ClientIP", 10800.0)
    again = sel.pick("a")
    assert all(sel.pick("a") == again for _ in range(20))


def test_expired_pins_do_not_accumulate() -> None:
    clock = Clock()
    sel = selector(endpoints(3), affinity="ClientIP", timeout=1.0, clock=clock)
    for i in range(100_000):
        sel.pick(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
        clock.now += 0.01  # about 100 clients are live at any time
    assert len(sel._pins) < 5000


def test_live_pins_are_bounded_and_the_least_recent_go_first() -> None:
    """150,000 client addresses all within the 3 h timeout (a scan, or a NAT pool): the pins stay
    at most MAX_PINS, the most recent clients keep theirs, and an evicted client is pinned afresh."""
    clock = Clock()
    sel = selector(endpoints(3), affinity="ClientIP", timeout=10800.0, clock=clock)
    first = {}
    for i in range(150_000):
        ip = f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"
        first[ip] = sel.pick(ip)
        clock.now += 0.001
        assert len(sel._pins) <= MAX_PINS + 1
    recent = [f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}" for i in range(149_000, 150_000)]
    assert all(sel.pick(ip) == first[ip] for ip in recent)  # the most recent keep their endpoint
    assert "10.0.0.0" not in sel._pins  # the oldest went
    again = sel.pick("10.0.0.0")
    assert all(sel.pick("10.0.0.0") == again for _ in range(5))


def test_failed_endpoint_backs_off_unless_all_do() -> None:
    clock = Clock()
    eps = endpoints(2)
    sel = selector(eps, "random", clock=clock)
    sel.failed(eps[0])
    assert {sel.pick("c") for _ in range(200)} == {eps[1]}
    sel.failed(eps[1])
    assert {sel.pick("c") for _ in range(200)} == set(eps)  # everyone backing off: use all
    clock.now += FAIL_BACKOFF + 0.1
    assert {sel.pick("c") for _ in range(200)} == set(eps)


def test_random_three_endpoints_uniform() -> None:
    """3 endpoints (where modulo bias of a coarse generator would show), 30,000 draws."""
    eps = endpoints(3)
    sel = selector(eps, "random")
    assert uniform_p(lambda: counts(sel, eps, 30_000)) >= 0.001
