"""explain against kube-proxy's own golden tests, transcribed into tests/explain/golden/kube-proxy/.

TestOverallIPTablesRules.txt is the expected iptables-restore input of kube-proxy's
pkg/proxy/iptables/proxier_test.go TestOverallIPTablesRules, TestOverallNFTablesRules.txt the
expected transaction of pkg/proxy/nftables/proxier_test.go TestOverallNFTablesRules (its baseRules
and the per-Service part), both verbatim. The Services are fixtures/kube_proxy_overall.yaml; the
node is each test's NewFakeProxier: node "test-node", pod CIDR 10.0.0.0/8 (detect-local by CIDR),
Service CIDR 172.30.0.0/16; iptables with no --nodeport-addresses (the NodePort tail rule matches
`--dst-type LOCAL`) and an iptables without --random-fully, nftables with 192.168.0.2 as the only
NodePort address.

Comparison: iptables byte for byte (our output is already in the order kube-proxy's
assertIPTablesRulesEqual sorts into); nftables as kube-proxy's assertNFTablesTransactionEqual
compares, after its sortNFTablesTransaction: blank and `#` lines dropped, lines ordered by object
kind (table, chain, rule, set, map, element), then object name, rules keeping the order they were
added in, other lines by their text.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from tests.explain.conftest import FIXTURES, GOLDEN
from usproxy.explain import nftables
from usproxy.offload.iptables import rules as iptables
from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set

KUBE_PROXY = GOLDEN / "kube-proxy"
FIXTURE = FIXTURES / "kube_proxy_overall.yaml"
POD_CIDR = (ipaddress.ip_network("10.0.0.0/8"),)
SERVICE_CIDR = (ipaddress.ip_network("172.30.0.0/16"),)
_KIND_ORDER = {"table": 10, "chain": 9, "rule": 8, "set": 7, "map": 6, "element": 5}


def _load(node: Node, path: Path = FIXTURE) -> ServiceSet:
    return service_set(load_manifests(path), node)


def sort_transaction(text: str) -> str:
    """kube-proxy's sortNFTablesTransaction (pkg/proxy/nftables/helpers_test.go), as described in
    this module's docstring."""
    lines = [line for line in text.split("\n") if line and not line.startswith("#")]

    def key(indexed: tuple[int, str]) -> tuple[int, str, int, str]:
        i, line = indexed
        words = line.split(" ")
        kind, name = words[1], words[4]
        if kind == "rule":
            return (-_KIND_ORDER.get(kind, 0), name, i, "")
        return (-_KIND_ORDER.get(kind, 0), name, 0, line)

    return "\n".join(line for _, line in sorted(enumerate(lines), key=key))


def test_overall_iptables_rules_as_kube_proxy_expects() -> None:
    node = Node("test-node", (), POD_CIDR, SERVICE_CIDR)
    got = iptables.render_ruleset(iptables.build(_load(node), 4, iptables.Options(random_fully=False)))
    assert got == (KUBE_PROXY / "TestOverallIPTablesRules.txt").read_text()


def test_overall_nftables_rules_as_kube_proxy_expects() -> None:
    node = Node("test-node", (ipaddress.ip_address("192.168.0.2"),), POD_CIDR, SERVICE_CIDR)
    got = nftables.dump(nftables.build(_load(node), 4))
    want = (KUBE_PROXY / "TestOverallNFTablesRules.txt").read_text()
    assert sort_transaction(got) == sort_transaction(want)


def test_sort_transaction_keeps_rule_order_and_drops_comments() -> None:
    text = ("# c\nadd element ip kube-proxy m { b }\nadd rule ip kube-proxy z 2\n\n"
            "add rule ip kube-proxy z 1\nadd element ip kube-proxy m { a }\nadd chain ip kube-proxy z\n")
    assert sort_transaction(text).split("\n") == [
        "add chain ip kube-proxy z", "add rule ip kube-proxy z 2", "add rule ip kube-proxy z 1",
        "add element ip kube-proxy m { a }", "add element ip kube-proxy m { b }"]
