"""Golden renderings: each of our fixtures × each view, compared with tests/explain/golden/.

The iptables and nftables renderers were checked line for line against kube-proxy's own expected
output (pkg/proxy/iptables/proxier_test.go TestOverallIPTablesRules and
pkg/proxy/nftables/proxier_test.go TestOverallNFTablesRules); these goldens pin that behaviour for
our Service sets (1, 3 and 0 endpoints, NodePort, externalTrafficPolicy Local, ClientIP affinity,
UDP, dual-stack, and kube_proxy_overall: the Services of those two kube-proxy tests, with
loadBalancerSourceRanges and a healthCheckNodePort, here rendered for our node; the comparison with
kube-proxy's own expected text is test_kube_proxy_golden.py). Regenerate after an intended change
with UPDATE_GOLDENS=1 and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.explain.conftest import GOLDEN, load
from usproxy.explain import bpf, cost, ipvs, nftables, registry, userspace
from usproxy.offload.iptables import rules as iptables
from usproxy.model.service_set import ServiceSet

VIEWS: dict[str, Callable[[ServiceSet], str]] = {
    "userspace": userspace.render,
    "iptables": iptables.render,
    "ipvs": ipvs.render,
    "nftables": lambda ss: nftables.render(ss, "list"),
    "nftables-dump": lambda ss: nftables.render(ss, "dump"),
    "bpf": bpf.render,
    "cost": lambda ss: cost.render(ss, registry.MODES),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_golden(fixture_name: str, view: str) -> None:
    got = VIEWS[view](load(fixture_name))
    path = GOLDEN / f"{fixture_name}.{view}.txt"
    if os.environ.get("UPDATE_GOLDENS"):
        path.write_text(got)
    assert path.exists(), f"missing golden {path.name}; run with UPDATE_GOLDENS=1"
    assert got == path.read_text()
