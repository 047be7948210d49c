"""Shared fixtures: throwaway network namespaces (root only), cleaned up whatever happens."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.netns import Topology


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
