"""Shared fixtures: throwaway network namespaces (root only), cleaned up whatever happens."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.netns import Topology
from usproxy.offload.pin_root import BPFFS, PIN_ROOT_ENV


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root for network namespaces")
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology()
    try:
        topo.build_node()
        yield topo
    finally:
        topo.close()


@pytest.fixture(scope="session", autouse=True)
def _bpf_pin_root_of_the_tests() -> Iterator[None]:
    """Agents the tests start without a pin root of their own get one no real agent uses: an agent
    without BPF removes an earlier run's pins at start (usproxy/app/cleanup.py) and must never find
    the machine's own (/sys/fs/bpf/usproxy). Removed at the end if anything pinned there."""
    root = BPFFS / f"usproxy-test-session-{os.getpid()}"
    os.environ.setdefault(PIN_ROOT_ENV, str(root))
    yield
    shutil.rmtree(root, ignore_errors=True)
