"""`usproxy explain diff OLD NEW` over the steps of kube-proxy's TestSyncProxyRulesRepeated
(tests/explain/repeated/, one manifest per state): each step's size is what kube-proxy's tests
say it sends. iptables: the line count of its golden partial iptables-restore input
(pkg/proxy/iptables/proxier_test.go); nftables: its NumOperations asserts
(pkg/proxy/nftables/proxier_test.go)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.explain.conftest import GOLDEN
from tests.explain.repeated_states import NODE, REPEATED, state
from usproxy.explain import cli, diff, nftables, registry
from usproxy.offload.iptables import rules as iptables
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


@pytest.mark.parametrize("before, after", [("1-initial", "2-svc3-added"), ("2-svc3-added", "3-svc2-deleted")])
def test_the_partial_iptables_restore_is_kube_proxys_own(before: str, after: str) -> None:
    """The lines diff prints as kube-proxy's partial sync are those of kube-proxy's
    TestSyncProxyRulesRepeated golden for that step (golden/kube-proxy/, transcribed from the
    version of pkg/proxy/iptables/proxier_test.go whose iptables has neither nfacct nor
    --random-fully), compared as its assertIPTablesRulesEqual compares: as sorted lines."""
    want = (GOLDEN / "kube-proxy" / f"TestSyncProxyRulesRepeated-{after}.txt").read_text().splitlines()
    opts = iptables.Options(nfacct=False, random_fully=False)
    assert sorted(diff.iptables_restore(state(before), state(after), opts)) == sorted(want)


@pytest.mark.parametrize("before, after, lines, ops", STEPS)
def test_diff_prints_what_kube_proxy_sends_line_by_line(before: str, after: str, lines: int, ops: int,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each count under "kube-proxy sends" is followed by that many lines: the partial
    iptables-restore, then the nftables transaction, whose lines add what NEW's dump holds and
    remove or flush only what OLD's held."""
    assert cli.main(["diff", str(REPEATED / f"{before}.yaml"), str(REPEATED / f"{after}.yaml"),
                     "--cluster-cidr", "10.0.0.0/8", "--node-name", "test-node"]) == 0
    out = capsys.readouterr().out
    sent = {}
    for block in out.split("# kube-proxy sends: ")[1:]:
        head, *body = block.splitlines()
        sent["nftables" if "nftables" in head else "iptables-restore"] = [x[4:] for x in body if x.startswith("#   ")]
    assert len(sent["iptables-restore"]) == lines and len(sent["nftables"]) == ops
    old_dump = nftables.dump(nftables.build(state(before), 4)).splitlines()
    new_dump = set(nftables.dump(nftables.build(state(after), 4)).splitlines())
    added: set[str] = set()
    for op in sent["nftables"]:
        verb, _, rest = op.partition(" ")
        kind, name = rest.split()[0], rest.split()[3]
        if verb == "add" and kind == "chain":
            added.add(name)
        elif verb == "add":
            assert op in new_dump, op
        else:  # delete an element of OLD; flush a chain of OLD, or one this transaction added
            assert verb in ("delete", "flush") and (name in added or any(
                line.startswith(f"add {kind} ip kube-proxy {name} ") or line == f"add {kind} ip kube-proxy {name}"
                for line in old_dump)), op


def test_a_re_padded_table_counts_only_its_changed_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fourth endpoint widens the userspace view's ENDPOINTS column: every row of both tables
    is re-padded, but only the changed row of each counts (and is shown as - and +)."""
    services = (Path(__file__).parents[2] / "examples" / "services.yaml").read_text()
    grown = services.replace(
        "    targetRef: {kind: Pod, name: web-3, namespace: default}\n",
        "    targetRef: {kind: Pod, name: web-3, namespace: default}\n  - addresses: [10.244.5.10]\n")
    (tmp_path / "old.yaml").write_text(services)
    (tmp_path / "new.yaml").write_text(grown)
    assert cli.main(["diff", str(tmp_path / "old.yaml"), str(tmp_path / "new.yaml"), "--mode", "userspace"]) == 0
    out = capsys.readouterr().out
    assert "# rendered rules: 4 lines changed (+2 -2)" in out
    changed_rows = [line for line in out.splitlines()
                    if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert len(changed_rows) == 4 and all("default/web:http" in row for row in changed_rows)
    assert sum("10.244.5.10:8080" in row for row in changed_rows) == 2
