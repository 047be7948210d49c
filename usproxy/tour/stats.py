"""The tour's statistics: percentiles of latencies, and the chi-square test of endpoint counts.

Pure functions, stdlib only (scipy is a test dependency, not the agent's: the tests compare
these with scipy.stats). `chi_square(counts)` tests observed counts against a uniform choice:
the statistic sum((o - e)^2 / e) with e = total / k, k - 1 degrees of freedom, and its p-value,
the chance that a really uniform choice gives a statistic at least this large: the regularized
upper incomplete gamma function Q(df/2, x/2), by its series below a + 1 and its continued
fraction above (the usual split, Numerical Recipes ch. 6.2), to about 1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linearly interpolated between the two nearest
    ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class ChiSquare:
    """Observed counts against a uniform choice among len(counts) endpoints."""

    statistic: float
    df: int
    p_value: float


def chi_square(counts: Sequence[int]) -> ChiSquare:
    """Pearson's chi-square of `counts` against equal expected counts."""
    if len(counts) < 2 or sum(counts) == 0:
        raise ValueError("chi-square needs at least two categories and one observation")
    expected = sum(counts) / len(counts)
    x = sum((c - expected) ** 2 / expected for c in counts)
    df = len(counts) - 1
    return ChiSquare(x, df, upper_gamma_q(df / 2.0, x / 2.0))


def upper_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), for a > 0, x >= 0."""
    if a <= 0 or x < 0:
        raise ValueError(f"Q(a, x) needs a > 0 and x >= 0, got a={a}, x={x}")
    if x == 0:
        return 1.0
    if x < a + 1:
        return max(0.0, 1.0 - _lower_series(a, x))
    return _upper_fraction(a, x)


def _prefix(a: float, x: float) -> float:
    """x^a e^-x / Gamma(a), in logarithms so that large arguments do not overflow."""
    return math.exp(a * math.log(x) - x - math.lgamma(a))


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its power series (converges fast for x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * _prefix(a, x)


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction, evaluated with Lentz's method (x >= a + 1)."""
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return h * _prefix(a, x)
