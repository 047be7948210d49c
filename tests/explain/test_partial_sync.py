""""Why, in numbers": the size of one change is what kube-proxy really sends, checked on the states
of kube-proxy's TestSyncProxyRulesRepeated (pkg/proxy/iptables/proxier_test.go and
pkg/proxy/nftables/proxier_test.go), transcribed as manifests under tests/explain/repeated/."""

from __future__ import annotations

from tests.explain.repeated_states import state
from usproxy.explain import cost, nftables, registry
from usproxy.offload.iptables import rules as iptables
from usproxy.model.service_set import FamilyPort, ServiceSet


def port(ss: ServiceSet, service: str) -> FamilyPort:
    return next(fp for fp in ss.family_ports(4) if fp.name.name == service)


def test_iptables_partial_sync_adding_svc3_is_kube_proxys_32_lines() -> None:
    ss = state("2-svc3-added")
    assert cost.iptables_partial_lines(iptables.build(ss, 4), (port(ss, "svc3"),)) == 32


def test_iptables_partial_sync_adding_an_endpoint_to_svc3_is_kube_proxys_36_lines() -> None:
    ss = state("7-svc3-endpoint-added")
    assert cost.iptables_partial_lines(iptables.build(ss, 4), (port(ss, "svc3"),)) == 36


def test_nftables_adding_an_endpoint_to_svc3_is_kube_proxys_12_operations() -> None:
    ss = state("7-svc3-endpoint-added")
    assert cost.nftables_ops(nftables.build(ss, 4), port(ss, "svc3")) == 12
    assert cost.nftables_ops(nftables.build(ss, 4), port(ss, "svc4")) == 8  # one endpoint: 2 chains


def test_the_numbers_section_shows_the_largest_change() -> None:
    text = cost.render(state("7-svc3-endpoint-added"), tuple(map(registry.by_name, ("iptables", "nftables"))))
    # full: *filter 12 lines; *nat 1 + 11 chain lines + 23 rules + COMMIT
    assert "36 lines of iptables-restore (full sync: 48)" in text
    assert "12 commands in one transaction" in text
