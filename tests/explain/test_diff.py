"""`usproxy explain diff OLD NEW` over the steps of kube-proxy's TestSyncProxyRulesRepeated
(tests/explain/repeated/, one manifest per state): each step's size is what kube-proxy's tests
say it sends. iptables: the line count of its golden partial iptables-restore input
(pkg/proxy/iptables/proxier_test.go); nftables: its NumOperations asserts
(pkg/proxy/nftables/proxier_test.go)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.explain.repeated_states import NODE, REPEATED, state
from usproxy.explain import cli, diff, registry
from usproxy.model.service_set import load_manifests, service_set

STEPS = [  # (before, after, iptables-restore lines, nftables operations)
    ("1-initial", "2-svc3-added", 32, 10),
    ("2-svc3-added", "3-svc2-deleted", 29, 4),
    ("3-svc2-deleted", "4-svc4-added", 26, 2),
    ("4-svc4-added", "5-svc4-endpoints-added", 32, 10),
    ("5-svc4-endpoints-added", "6-svc3-endpoint-changed", 34, 9),
    ("6-svc3-endpoint-changed", "7-svc3-endpoint-added", 36, 12),
]


@pytest.mark.parametrize("before, after, lines, ops", STEPS)
def test_each_step_sends_what_kube_proxy_sends(before: str, after: str, lines: int, ops: int) -> None:
    old, new = state(before), state(after)
    assert diff.iptables_sends(old, new) == lines
    assert diff.nftables_sends(old, new) == ops


def test_diff_shows_one_endpoint_added_in_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["diff", str(REPEATED / "6-svc3-endpoint-changed.yaml"),
                   str(REPEATED / "7-svc3-endpoint-added.yaml"), "--cluster-cidr", "10.0.0.0/8",
                   "--node-name", "test-node"])
    out = capsys.readouterr().out
    assert rc == 0 and "#   ns3/svc3:p80: endpoint 10.0.3.3:80 added" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("==== ")] == [
        "1.", "2.", "3.", "4.", "5."]
    assert "# kube-proxy sends: 36 lines of iptables-restore" in out
    assert "# kube-proxy sends: 12 operations in one nftables transaction" in out
    assert "-add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 numgen random mod 1 vmap" in out
    assert "+add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 numgen random mod 2 vmap" in out
    assert "--probability 0.5000000000 -j KUBE-SEP-DKCFIS26GWF2WLWC" in out  # the ladder rewritten
    assert "+  -> 10.0.3.3:80" in out  # one IPVS real server
    assert "+                                         2 => 10.0.3.3:80/TCP" in out  # one BPF backend slot


def test_no_change_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REPEATED / "1-initial.yaml")
    assert cli.main(["diff", path, path]) == 0
    assert "no change" in capsys.readouterr().out


UDP = """apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {namespace: ns1, name: dns}
  spec:
    clusterIP: 172.30.0.10
    ports: [{name: dns, port: 53, protocol: UDP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {namespace: ns1, name: dns-1, labels: {kubernetes.io/service-name: dns}}
  addressType: IPv4
  ports: [{name: dns, port: 53, protocol: UDP}]
  endpoints: [%s]
"""


def test_udp_endpoint_changes_list_the_conntrack_entries_kube_proxy_deletes(tmp_path: Path) -> None:
    files = {}
    for name, eps in (("two", "{addresses: [10.0.1.1]}, {addresses: [10.0.1.2]}"),
                      ("one", "{addresses: [10.0.1.2]}"), ("none", "")):
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(UDP % eps)
    two, one, none = (service_set(load_manifests(files[n]), NODE) for n in ("two", "one", "none"))
    assert diff.conntrack_deletes(two, one) == [
        "conntrack -D -p udp --orig-dst 172.30.0.10 --dst-nat 10.0.1.1  (flows to ns1/dns:dns DNATed to "
        "removed endpoint 10.0.1.1:53)"]
    (back,) = diff.conntrack_deletes(none, one)
    assert back.startswith("conntrack -D -p udp --orig-dst 172.30.0.10  (ns1/dns:dns had no endpoint")


def test_one_changed_line_is_said_in_the_singular() -> None:
    old, new = state("6-svc3-endpoint-changed"), state("7-svc3-endpoint-added")
    text = diff.render(old, new, (registry.by_name("bpf"),), lambda ss, mode: "x\n" if ss is new else "",
                       {"bpf": "1. bpf"})
    assert "# rendered rules: 1 line changed (+1 -0)" in text


def test_diff_takes_nft_format(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(REPEATED / "6-svc3-endpoint-changed.yaml"), str(REPEATED / "7-svc3-endpoint-added.yaml")]
    assert cli.main(["diff", *paths, "--mode", "nftables", "--nft-format", "list"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("+") and "numgen random mod 2 vmap" in line and "add rule" not in line
               for line in out.splitlines())  # `nft list table` text
    assert not any(line.startswith("+add rule") for line in out.splitlines())
    assert cli.main(["diff", *paths, "--mode", "nftables"]) == 0  # dump, as before
    assert "+add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 numgen random mod 2" in capsys.readouterr().out
