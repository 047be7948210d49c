"""Relay fixtures: each relay test runs on both event loops (uvloop and asyncio)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.relay.harness import Backends


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backends(topology: Topology) -> Iterator[Backends]:
    b = Backends(topology)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
