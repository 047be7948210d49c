"""Everything withdrawn on a local error (issue 18 item 4): every descriptor the relay holds is
budgeted. Listeners count against the same budget as flows (a TCP flow two descriptors, a UDP
flow one), so listeners plus flows can never take the descriptors the manifest reader, the admin
servers and libnftables need (FD_RESERVE)."""

from __future__ import annotations

import errno

import pytest

from usproxy.conntrack.flow_table import FlowTableFull
from usproxy.relay.flow_admission import FD_RESERVE, FlowAdmission
from usproxy.types import ServicePortName

SPN = ServicePortName("default", "web", "http", "TCP")
CLIENT = ("10.0.0.1", 40000)
FRONTEND = ("10.96.0.1", 80)


def test_everything_withdrawn_on_a_local_error_listeners_count_against_the_flow_budget() -> None:
    listeners: set[tuple[str, int, str]] = set()
    evicted: list[bool] = []
    adm = FlowAdmission.within(1_000_000, 1024, lambda: bool(evicted.append(True)), listeners)
    assert adm.descriptors == 1024 - FD_RESERVE
    budget = adm.descriptors
    assert budget is not None
    for i in range(budget - 10):  # listeners take all but 10 descriptors of the budget
        listeners.add((f"10.96.{i // 250}.{i % 250}", 80, "TCP"))
    flows = [adm.admit("TCP", SPN, CLIENT, FRONTEND) for _ in range(5)]  # 10 descriptors
    assert adm.descriptors_held() == budget
    with pytest.raises(FlowTableFull, match="descriptor budget"):
        adm.admit("TCP", SPN, CLIENT, FRONTEND)
    with pytest.raises(FlowTableFull):
        adm.admit("UDP", SPN, CLIENT, FRONTEND)
    with pytest.raises(OSError) as err:
        adm.reserve_listener()
    assert err.value.errno == errno.EMFILE
    assert evicted and adm.table.refused == 2  # room was sought first, then the flow refused
    adm.release(flows[0])
    adm.reserve_listener()  # two descriptors are free again
    assert adm.admit("UDP", SPN, CLIENT, FRONTEND) is not None
