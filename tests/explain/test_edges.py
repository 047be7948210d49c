"""`usproxy explain` at its edges (issue 14 item 5): one mode's numbers only, a NodePort traced
without --node-ip, the iptables entry jumps, empty input, parse errors with a position, and
`--live` state that no running agent owns. Each test reads only files and pins it creates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.explain.conftest import FIXTURES
from usproxy.explain import cli


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def number_rows(out: str) -> list[str]:
    """The MODE column of the "why, in numbers" table."""
    lines = out[out.index(". why, in numbers ===="):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("MODE "))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split("  ")[0])
    return rows


@pytest.mark.parametrize("mode, rows", [
    ("ipvs", ["ipvs"]), ("iptables", ["iptables"]), ("nftables", ["nftables"]), ("bpf", ["bpf"]),
    ("userspace", ["userspace (1.0)", "usproxy relay"]),
])
def test_one_mode_shows_only_its_numbers(mode: str, rows: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--services", str(FIXTURES / "nodeport.yaml"), "--mode", mode], capsys)
    assert rc == 0 and number_rows(out) == rows
    headings = [line.split()[1] for line in out.splitlines() if line.startswith("==== ")]
    assert headings == ["1.", "2."]  # its view, then its numbers: numbered as shown
    assert ("REALLY GETS" in out) == (mode == "iptables")  # the probability ladder is iptables'


def test_nodeport_trace_without_node_ip_says_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["trace", "10.0.0.1", "192.168.0.2:30080/TCP", "--services", str(FIXTURES / "nodeport.yaml"),
            "--mode", "iptables"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "NodePort of web/front:http" in out and "pass --node-ip 192.168.0.2" in out
    rc, out, _ = run([*argv, "--node-ip", "192.168.0.2"], capsys)
    assert rc == 0 and "--node-ip" not in out and "=> DNAT to" in out


LB_WITH_RANGES = """
apiVersion: v1
kind: Service
metadata: {name: svc1, namespace: ns1}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.41
  ports: [{name: p80, port: 80, targetPort: 80, nodePort: 30001, protocol: TCP}]
  loadBalancerSourceRanges: ["192.168.0.0/24", "203.0.113.0/25"]
status: {loadBalancer: {ingress: [{ip: 1.2.3.4}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc1-1, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.1], conditions: {ready: true}}]
"""


def test_same_node_to_lb_is_allowed_with_the_node_address_and_said_without(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kube-proxy's "same node to LB1, SNATted to LB1 (implicitly allowed)": KUBE-FW-* accepts the
    LB IP as a source when a range holds the node's address; without --node-ip explain cannot
    know that, drops as kube-proxy would on such a node, and says why."""
    path = tmp_path / "lb.yaml"
    path.write_text(LB_WITH_RANGES)
    argv = ["trace", "1.2.3.4", "1.2.3.4:80/TCP", "--services", str(path), "--mode", "iptables"]
    rc, out, _ = run([*argv, "--node-ip", "192.168.0.2"], capsys)
    assert rc == 0 and "-s 1.2.3.4 -j KUBE-EXT-" in out and "=> DNAT to 10.180.0.1:80" in out
    assert "# note:" not in out
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "=> DROP" in out
    assert "# note: 1.2.3.4 is a LoadBalancer IP of ns1/svc1:p80" in out and "(given: none)" in out


@pytest.mark.parametrize("text", ["", "# only a comment\n", "apiVersion: v1\nkind: List\nitems: []\n"])
def test_empty_input_says_there_is_nothing_to_show(text: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    rc, out, err = run(["--services", str(path)], capsys)
    assert rc == 1 and out == "" and f"no Service with a ClusterIP in {path}: nothing to show" in err
    rc, out, err = run(["trace", "10.0.0.1", "10.96.0.1:80/TCP", "--services", str(path)], capsys)
    assert rc == 1 and out == "" and "nothing to show" in err


@pytest.mark.parametrize("name, text, where", [
    ("bad.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: a\n  x: [\n", "line 4, column 4"),
    ("tab.yaml", "kind: Service\n\tmetadata: {}\n", "line 2, column 1"),
    ("bad.json", '{"apiVersion": "v1",\n "kind": "Service",, }\n', "line 2, column 20"),
])
def test_parse_errors_name_file_line_and_column(name: str, text: str, where: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from usproxy.app import cli as top

    path = tmp_path / name
    path.write_text(text)
    rc = top.main(["explain", "--services", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}: cannot parse at {where}: " in err
    assert "<unicode string>" not in err


@pytest.fixture
def stub_pins(monkeypatch: pytest.MonkeyPatch, own_pin_root: Path, tmp_path: Path) -> Path:
    """Pins "left" under the test's own pin root (the reader is replaced: it answers only for that
    root), no nftables table, and the agent's lock directory moved under tmp_path."""
    from usproxy.util import locks
    from usproxy.explain import live
    from usproxy.offload.bpf import view

    def render_pinned(pin_root: Path | None = None) -> str | None:
        return f"# bpf socket LB pinned at {own_pin_root}/v1" if pin_root in (None, own_pin_root) else None

    monkeypatch.setattr(view, "render_pinned", render_pinned)
    monkeypatch.setattr(live, "nft_tables", lambda: [])
    monkeypatch.setattr(locks, "LOCK_DIR", tmp_path / "run")
    return tmp_path / "run"


def test_live_marks_pins_no_running_agent_owns_as_orphaned(stub_pins: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from tests.explain.conftest import dead_address

    rc, out, _ = run(["--live", "--metrics-bind-address", dead_address()], capsys)
    assert rc == 0 and "# live kernel state (bpf pins): ORPHANED: no running usproxy agent" in out
    assert out.index("ORPHANED") < out.index("# bpf socket LB pinned at")


def test_live_marks_pins_of_the_agent_holding_the_offload_lock_as_owned(
        stub_pins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from tests.explain.conftest import dead_address
    from usproxy.util.locks import NetnsLock

    lock = NetnsLock("offload")  # what a running offloading agent holds
    lock.acquire()
    try:
        rc, out, _ = run(["--live", "--metrics-bind-address", dead_address()], capsys)
    finally:
        lock.release()
    assert rc == 0 and f"owned by the running agent, pid {os.getpid()}" in out and "ORPHANED" not in out


NAT_ENTRY = ['-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
             '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
             '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING']


def test_iptables_view_and_trace_show_the_entry_jumps(capsys: pytest.CaptureFixture[str]) -> None:
    clusterip = str(FIXTURES / "clusterip.yaml")
    rc, out, _ = run(["--services", clusterip, "--mode", "iptables"], capsys)
    nat = out[out.index("# entry jumps"):].split("*nat\n")[1].split("\nCOMMIT")[0].splitlines()
    assert rc == 0 and nat == NAT_ENTRY  # as kube-proxy's iptables-save shows them, in that order
    assert ('-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" '
            "-j KUBE-SERVICES") in out
    for src, first in (("10.244.9.9", "nat PREROUTING rule 1"), ("192.168.0.2", "nat OUTPUT rule 1")):
        rc, out, _ = run(["trace", src, "10.96.1.1:80/TCP", "--services", clusterip, "--mode", "iptables",
                          "--node-ip", "192.168.0.2", "--detail"], capsys)
        walk = out[out.index("## iptables"):].splitlines()[1:]
        hops = [line.strip() for line in walk if line.startswith("  ") and not line.startswith("  path ")]
        assert rc == 0 and hops[0].startswith(first), src
        assert f"nat POSTROUTING rule 1: {NAT_ENTRY[2]}" in hops
