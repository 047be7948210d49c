"""`usproxy explain --kubeconfig`: one list from the (fake) API server renders like manifests;
an unreachable server is a runtime failure (exit 1), a missing kubeconfig bad input (exit 2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.sources.conftest import eps, svc
from tests.sources.fake_apiserver import FakeApiServer
from usproxy.app.cli import main


async def test_explain_lists_the_api_servers_services(api: FakeApiServer, kubeconfig: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    api.apply("services", svc("web", "10.96.10.10"))
    api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5", "10.244.2.5"]))
    rc = await asyncio.to_thread(main, ["explain", "--kubeconfig", str(kubeconfig), "--mode", "iptables"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "-d 10.96.10.10 --dport 80" in out and "--to-destination 10.244.2.5:8080" in out


async def test_unreachable_server_exits_1(api: FakeApiServer, kubeconfig: Path) -> None:
    await api.stop()
    rc = await asyncio.to_thread(main, ["explain", "--kubeconfig", str(kubeconfig)])
    assert rc == 1


def test_missing_kubeconfig_exits_2(tmp_path: Path) -> None:
    assert main(["explain", "--kubeconfig", str(tmp_path / "nope")]) == 2
