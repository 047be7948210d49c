"""The tour's statistics against scipy's (a test dependency; the tour itself needs none):
percentiles as numpy interpolates them, Pearson's chi-square and its p-value, and the upper
incomplete gamma function behind it, across degrees of freedom and statistics small and large."""

from __future__ import annotations

import math
import random

import numpy
import pytest
from scipy import special, stats as sstats

from usproxy.tour.stats import chi_square, percentile, upper_gamma_q


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentiles_are_numpys_linear_ones(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1 / 300) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)), rel=1e-12)
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("counts", [[2000, 2000, 2000, 2000, 2000], [2012, 1994, 1928, 2075, 1991],
                                    [1900, 2100, 2000, 2000, 2000], [2500, 1500, 2000, 2000, 2000],
                                    [5, 0, 0, 0, 0], [510, 490], [1] * 20 + [30]])
def test_chi_square_and_its_p_value_are_scipys(counts: list[int]) -> None:
    ours = chi_square(counts)
    theirs = sstats.chisquare(counts)
    assert ours.statistic == pytest.approx(float(theirs.statistic), rel=1e-12, abs=1e-12)
    assert ours.df == len(counts) - 1
    assert ours.p_value == pytest.approx(float(theirs.pvalue), rel=1e-9, abs=1e-15)


def test_the_upper_incomplete_gamma_function_is_scipys() -> None:
    for a in (0.5, 1, 1.5, 2, 4.5, 10, 50):
        for x in (0, 1e-6, 0.1, 0.9, a, a + 1, 2 * a + 3, 30, 200):
            assert upper_gamma_q(a, x) == pytest.approx(float(special.gammaincc(a, x)), rel=1e-9, abs=1e-300)


def test_a_test_needs_two_endpoints_and_a_connection() -> None:
    with pytest.raises(ValueError):
        chi_square([100])
    with pytest.raises(ValueError):
        chi_square([0, 0, 0])
