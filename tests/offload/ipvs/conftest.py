"""The IPVS tests' machine: br_netfilter where IPVS runs (guest.bridge_netfilter says why)."""

from __future__ import annotations

import pytest

from tests.offload.ipvs.guest import bridge_netfilter, ipvs_here


@pytest.fixture(autouse=True, scope="session")
def _bridge_netfilter() -> None:
    if ipvs_here():
        bridge_netfilter()
