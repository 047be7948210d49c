"""`explain --live` shows every usproxy nftables table that exists, IPv4 and IPv6 (the offload's
`ip usproxy` and `ip6 usproxy`; there is no `inet` table). The nft command, the agent and the
BPF pins are replaced, so nothing of the machine's own state is read."""

from __future__ import annotations

import subprocess
import urllib.error
from typing import Any

import pytest

from usproxy.explain import live
from usproxy.offload.bpf import view


def fake_nft(monkeypatch: pytest.MonkeyPatch, tables: dict[str, str]) -> list[list[str]]:
    """`nft list table <family> usproxy` answering from `tables` (family -> listing)."""
    asked: list[list[str]] = []

    def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        asked.append(argv)
        family = argv[3]
        if family in tables:
            return subprocess.CompletedProcess(argv, 0, tables[family], "")
        return subprocess.CompletedProcess(argv, 1, "", "Error: No such file or directory")

    monkeypatch.setattr("usproxy.explain.live.shutil.which", lambda name: "/usr/sbin/nft")
    monkeypatch.setattr("usproxy.explain.live.subprocess.run", run)
    return asked


@pytest.fixture(autouse=True)
def no_agent_no_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(addr: str, path: str) -> Any:
        raise urllib.error.URLError("connection refused")

    monkeypatch.setattr(live, "_get", unreachable)
    monkeypatch.setattr(view, "render_pinned", lambda: None)


def test_both_families_tables_are_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_nft(monkeypatch, {"ip": "table ip usproxy {\n  map service-ips\n}\n",
                                   "ip6": "table ip6 usproxy {\n  map slot-0\n}\n"})
    out = live.read_live("127.0.0.1:10249")
    assert out is not None
    assert out.index("# live: nft list table ip usproxy\ntable ip usproxy") < out.index(
        "# live: nft list table ip6 usproxy\ntable ip6 usproxy")
    assert [a[1:] for a in asked] == [["list", "table", "ip", "usproxy"], ["list", "table", "ip6", "usproxy"]]


def test_an_ipv6_only_table_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nft(monkeypatch, {"ip6": "table ip6 usproxy {\n}\n"})
    out = live.read_live("127.0.0.1:10249")
    assert out is not None and "# live: nft list table ip6 usproxy" in out and "table ip usproxy" not in out


def test_no_table_no_agent_no_pins_is_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nft(monkeypatch, {})
    assert live.read_live("127.0.0.1:10249") is None
