"""DSR mode below the three-node test (tests/cluster/test_tc_dsr.py): which tc groups (NodePorts
with externalIPs, LoadBalancer IPs) the datapath flags F_DSR, and how a DSR conntrack entry shows
in /flows."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from tests.offload.bpf.builders import ep, spn, state
from usproxy.offload.bpf import nodeport
from usproxy.offload.bpf.datapath import LB_GROUP, NODEPORT_GROUP, BpfDatapath
from usproxy.offload.bpf.layout import CT_DSR, CT_ORIGINAL, F_DSR, F_LOCAL_ONLY, CtEntry
from usproxy.model.config import BpfLbMode

V4 = ipaddress.IPv4Address


@pytest.mark.parametrize("mode, etp, dsr", [("snat", "Cluster", False), ("dsr", "Cluster", True),
                                            ("dsr", "Local", False), ("snat", "Local", False)])
def test_only_cluster_policy_tc_frontends_in_dsr_mode_are_flagged(mode: BpfLbMode, etp: str, dsr: bool) -> None:
    dp = BpfDatapath(nodeport_cidrs=(), lb_mode=mode)
    dp.traffic = frozenset({"local", "forwarded"})
    st = state(spn("web"), "10.96.0.10", 80, [ep("10.244.1.5", node_name="node")], node_port=30080,
               external_traffic_policy=etp, external_ips=(V4("198.51.100.21"),),
               load_balancer_ips=(V4("198.51.100.20"),))
    want = dp._wants(spn("web"), st)
    for group in (NODEPORT_GROUP, LB_GROUP):  # NodePort and externalIP; LB IP: DSR as Cilium's
        assert bool(want[group].flags & F_DSR) == dsr, group
        assert bool(want[group].flags & F_LOCAL_ONLY) == (etp == "Local")
    assert not any(w.flags & F_DSR for k, w in want.items() if k not in (NODEPORT_GROUP, LB_GROUP))  # ClusterIPs


def test_a_dsr_entry_shows_as_dsr_in_flows() -> None:
    e = CtEntry(V4("203.0.113.10"), V4("192.0.2.11"), 40000, 30090, 6, CT_ORIGINAL, V4("0.0.0.0"),
                V4("10.244.2.10"), 0, 8080, 7, 9, CT_DSR, 0, 0, 3)
    row = nodeport.ct_row(e, "default/dsr:http", 10)
    assert row["state"] == "DSR" and row["reply"] == {"src": "10.244.2.10:8080", "dst": "203.0.113.10:40000"}
    assert nodeport.ct_row(dataclasses.replace(e, flags=0), "x", 10)["state"] == "NAT"
