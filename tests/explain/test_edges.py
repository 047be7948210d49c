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
    lines = out[out.index("==== 6. why, in numbers"):].splitlines()
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
    assert ("REALLY GETS" in out) == (mode == "iptables")  # the probability ladder is iptables'


def test_nodeport_trace_without_node_ip_says_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["trace", "10.0.0.1", "192.168.0.2:30080/TCP", "--services", str(FIXTURES / "nodeport.yaml"),
            "--mode", "iptables"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "NodePort of web/front:http" in out and "pass --node-ip 192.168.0.2" in out
    rc, out, _ = run([*argv, "--node-ip", "192.168.0.2"], capsys)
    assert rc == 0 and "--node-ip" not in out and "=> DNAT to" in out
