"""Everything withdrawn on a local error (issue 18 item 4): every descriptor the relay holds is
budgeted. Listeners count against the same budget as flows (a TCP flow two descriptors, a UDP
flow one), so listeners plus flows can never take the descriptors the manifest reader, the admin
servers and libnftables need (FD_RESERVE)."""

from __future__ import annotations

import errno

import pytest

from usproxy.flows.flow_table import FlowTableFull
from usproxy.relay.flow_admission import FD_RESERVE, PRESSURE, FlowAdmission
from usproxy.model.types import ServicePortName

SPN = ServicePortName("default", "web", "http", "TCP")
CLIENT = ("10.0.0.1", 40000)
FRONTEND = ("10.96.0.1", 80)


def test_everything_withdrawn_on_a_local_error_listeners_count_against_the_flow_budget() -> None:
    listeners: set[tuple[str, int, str]] = set()
    evicted: list[bool] = []

    def evict() -> bool:
        evicted.append(True)
        return False  # nothing to evict: the budget must refuse

    adm = FlowAdmission.within(1_000_000, 1024, evict, listeners)
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


def test_spliced_flows_pipes_count_against_the_budget_and_stop_short_of_its_pressure_mark() -> None:
    """A spliced TCP flow's two pipes are four more descriptors (usproxy/relay/tcp_splice.py):
    counted while held, refused once they would take the budget past its pressure mark (splicing
    is optional: the flow stays on the event loop, and new flows keep their room), given back."""
    adm = FlowAdmission.within(1_000_000, 1024, lambda: False)
    budget = adm.descriptors
    assert budget is not None
    flows = [adm.admit("TCP", SPN, ("10.0.0.1", 40000 + i), FRONTEND) for i in range(100)]
    assert adm.descriptors_held() == 200
    granted = 0
    while adm.reserve_pipes():
        granted += 1
    assert adm.descriptors_held() == 200 + 4 * granted
    assert budget * PRESSURE - 4 < adm.descriptors_held() <= budget * PRESSURE
    adm.release_pipes()
    assert adm.descriptors_held() == 200 + 4 * (granted - 1)
    assert adm.reserve_pipes()  # the four given back fit again
    for f in flows:
        adm.release(f)
    assert adm.descriptors_held() == 4 * granted
