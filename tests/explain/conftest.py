"""Fixtures for the explain tests: our own Service sets under fixtures/, rendered for node-a, and
a BPF pin root of the test's own for `--live` (never the machine's: a real agent may have pins)."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest

from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set
from usproxy.offload.pin_root import PIN_ROOT_ENV

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "golden"
NODE = Node(
    name="node-a",
    ips=(ipaddress.ip_address("192.168.0.2"), ipaddress.ip_address("2001:db8::2")),
    cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00:10:244::/64")),
    service_cidrs=(ipaddress.ip_network("10.96.0.0/16"),),
)
FIXTURE_NAMES = tuple(sorted(p.stem for p in FIXTURES.glob("*.yaml")))


def load(name: str, node: Node = NODE) -> ServiceSet:
    return service_set(load_manifests(FIXTURES / f"{name}.yaml"), node)


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def own_pin_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pin root under tmp_path, made the default (USPROXY_BPF_PINS) for this test."""
    root = tmp_path / "bpf-pins"
    monkeypatch.setenv(PIN_ROOT_ENV, str(root))
    return root


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
