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


NEW = """apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {namespace: default, name: web}
  spec:
    clusterIP: 10.96.10.10
    ports: [{name: http, port: 80, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {namespace: default, name: web-1, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.5], nodeName: node-a}
  - {addresses: [10.244.2.5], nodeName: node-a}
  - {addresses: [10.244.3.5], nodeName: node-a}
"""


async def test_diff_takes_the_api_servers_state_as_old(api: FakeApiServer, kubeconfig: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    api.apply("services", svc("web", "10.96.10.10"))
    api.apply("endpointslices", eps("web-1", "web", ["10.244.1.5", "10.244.2.5"]))
    new = tmp_path / "new.yaml"
    new.write_text(NEW)
    rc = await asyncio.to_thread(main, ["explain", "diff", "--kubeconfig", str(kubeconfig), str(new),
                                        "--mode", "nftables"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "#   default/web:http: endpoint 10.244.3.5:8080 added" in out
    assert "numgen random mod 2 vmap" in out and "numgen random mod 3 vmap" in out


async def test_diff_with_kubeconfig_takes_new_only(api: FakeApiServer, kubeconfig: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    new = tmp_path / "new.yaml"
    new.write_text(NEW)
    with pytest.raises(SystemExit) as exc:
        await asyncio.to_thread(main, ["explain", "diff", "--kubeconfig", str(kubeconfig), str(new), str(new)])
    assert exc.value.code == 2
    assert "with --kubeconfig, give NEW only" in capsys.readouterr().err


async def test_diff_against_an_unreachable_server_exits_1(api: FakeApiServer, kubeconfig: Path,
                                                         tmp_path: Path) -> None:
    await api.stop()
    new = tmp_path / "new.yaml"
    new.write_text(NEW)
    rc = await asyncio.to_thread(main, ["explain", "diff", "--kubeconfig", str(kubeconfig), str(new)])
    assert rc == 1


def test_diff_with_a_missing_new_exits_2_before_asking_the_server(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    kubeconfig = tmp_path / "kubeconfig"  # not even read: NEW is checked first
    rc = main(["explain", "diff", "--kubeconfig", str(kubeconfig), str(tmp_path / "nope.yaml")])
    assert rc == 2
    assert "nope.yaml" in capsys.readouterr().err
