"""The 1/(n-i) probability ladder: formatted as kube-proxy formats it, and giving uniform shares.

The simulation reads the probabilities back out of the rendered KUBE-SVC chain text, so it checks
what would really be installed, and walks the chain as the kernel does (first matching rule wins).
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest
from scipy.stats import chisquare

from tests.explain.conftest import load
from usproxy.explain import cost
from usproxy.offload.iptables import rules as iptables


def test_probability_text_matches_kube_proxy_format() -> None:
    assert [iptables.probability(n) for n in (4, 3, 2)] == ["0.2500000000", "0.3333333333", "0.5000000000"]


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_exact_shares_are_uniform(n: int) -> None:
    rows = cost.ladder(n)
    assert [share for _, _, share in rows] == [Fraction(1, n)] * n
    assert rows[0][1] == 1 and rows[-1][0] == "(always)"


def svc_probabilities() -> list[float | None]:
    """Probabilities of shop/cart:http's KUBE-SVC chain (three endpoints), from the rendered text."""
    text = iptables.render(load("clusterip"))
    rules = [line for line in text.splitlines()
             if line.startswith("-A KUBE-SVC-") and "shop/cart:http ->" in line]
    assert len(rules) == 3
    out: list[float | None] = []
    for line in rules:
        m = re.search(r"--probability (\S+)", line)
        out.append(float(m.group(1)) if m else None)
    return out


def test_rendered_chain_gives_uniform_shares() -> None:
    probs = svc_probabilities()
    assert probs[-1] is None  # the last rule always matches
    rng, counts, trials = random.Random(8), [0, 0, 0], 60_000
    for _ in range(trials):
        for i, p in enumerate(probs):
            if p is None or rng.random() < p:
                counts[i] += 1
                break
    assert sum(counts) == trials
    assert chisquare(counts).pvalue > 0.001
    assert all(abs(c / trials - 1 / 3) < 0.01 for c in counts)


def test_naive_equal_probabilities_would_not_be_uniform() -> None:
    """Why 1/(n-i): 1/n on every rule would give the first endpoint the most."""
    n = 3
    naive = [Fraction(1, n) * (1 - Fraction(1, n)) ** i for i in range(n - 1)]
    assert naive[0] > naive[1]
