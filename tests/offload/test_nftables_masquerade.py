"""Masquerade and the externalTrafficPolicy Local short-circuit in the nftables layout, without a
kernel: kube-proxy's TestInternalExternalMasquerade (pkg/proxy/nftables/proxier_test.go) flows
and its four proxier configurations (local-traffic detector or not, masqueradeAll or not), traced
through the rules the datapath writes (tests/offload/nft_trace.py). Its LoadBalancer addresses
(public in kube-proxy's test) are moved to 198.51.100.0/24; everything else is its test data."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.node import NodeFacts
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNft, FakeNftClient
from usproxy.offload.nftables.readback import read_table

from tests.offload.helpers import ep, spn, state
from tests.offload.nft_trace import trace
from tests.offload.nftables_fakes import NoConntrack

NODE_IP, EXTERNAL, POD = "192.168.0.2", "203.0.113.2", "10.0.0.2"
LOCAL = [NODE_IP]
DETECTOR = local_detector("ClusterCIDR", cluster_cidrs=("10.0.0.0/8",))
# (name, cluster IP, node port, LB IP, extra ServicePort fields, local endpoint, remote endpoint)
SERVICES: list[tuple[str, str, int, str, dict[str, Any], str, str]] = [
    ("svc1", "172.30.0.41", 3001, "198.51.100.4", {}, "10.180.0.1", "10.180.1.1"),
    ("svc2", "172.30.0.42", 3002, "198.51.100.8", {"external_traffic_policy": "Local"}, "10.180.0.2", "10.180.1.2"),
    ("svc3", "172.30.0.43", 3003, "198.51.100.12", {"internal_traffic_policy": "Local"}, "10.180.0.3", "10.180.1.3"),
]
BOTH = {n: f"{loc}:80, {rem}:80" for n, _, _, _, _, loc, rem in SERVICES}
ONLY_LOCAL = {n: f"{loc}:80" for n, _, _, _, _, loc, _ in SERVICES}

# (flow name, source, destination, port, expected endpoints, masqueraded): the "base" case
FLOWS: list[tuple[str, str, str, int, str, bool]] = [
    ("pod to ClusterIP", POD, "172.30.0.41", 80, BOTH["svc1"], False),
    ("pod to NodePort", POD, NODE_IP, 3001, BOTH["svc1"], True),
    ("pod to LB", POD, "198.51.100.4", 80, BOTH["svc1"], True),
    ("node to ClusterIP", NODE_IP, "172.30.0.41", 80, BOTH["svc1"], True),
    ("node to NodePort", NODE_IP, NODE_IP, 3001, BOTH["svc1"], True),
    ("node to LB", NODE_IP, "198.51.100.4", 80, BOTH["svc1"], True),
    ("external to ClusterIP", EXTERNAL, "172.30.0.41", 80, BOTH["svc1"], True),
    ("external to NodePort", EXTERNAL, NODE_IP, 3001, BOTH["svc1"], True),
    ("external to LB", EXTERNAL, "198.51.100.4", 80, BOTH["svc1"], True),
    ("pod to ClusterIP with eTP:Local", POD, "172.30.0.42", 80, BOTH["svc2"], False),
    ("pod to NodePort with eTP:Local", POD, NODE_IP, 3002, BOTH["svc2"], False),
    ("pod to LB with eTP:Local", POD, "198.51.100.8", 80, BOTH["svc2"], False),
    ("node to ClusterIP with eTP:Local", NODE_IP, "172.30.0.42", 80, BOTH["svc2"], True),
    ("node to NodePort with eTP:Local", NODE_IP, NODE_IP, 3001, BOTH["svc1"], True),  # port 3001 as kube-proxy's
    ("node to LB with eTP:Local", NODE_IP, "198.51.100.8", 80, BOTH["svc2"], True),
    ("external to ClusterIP with eTP:Local", EXTERNAL, "172.30.0.42", 80, BOTH["svc2"], True),
    ("external to NodePort with eTP:Local", EXTERNAL, NODE_IP, 3002, ONLY_LOCAL["svc2"], False),
    ("external to LB with eTP:Local", EXTERNAL, "198.51.100.8", 80, ONLY_LOCAL["svc2"], False),
    ("pod to ClusterIP with iTP:Local", POD, "172.30.0.43", 80, ONLY_LOCAL["svc3"], False),
    ("pod to NodePort with iTP:Local", POD, NODE_IP, 3003, BOTH["svc3"], True),
    ("pod to LB with iTP:Local", POD, "198.51.100.12", 80, BOTH["svc3"], True),
    ("node to ClusterIP with iTP:Local", NODE_IP, "172.30.0.43", 80, ONLY_LOCAL["svc3"], True),
    ("node to NodePort with iTP:Local", NODE_IP, NODE_IP, 3003, BOTH["svc3"], True),
    ("node to LB with iTP:Local", NODE_IP, "198.51.100.12", 80, BOTH["svc3"], True),
    ("external to ClusterIP with iTP:Local", EXTERNAL, "172.30.0.43", 80, ONLY_LOCAL["svc3"], True),
    ("external to NodePort with iTP:Local", EXTERNAL, NODE_IP, 3003, BOTH["svc3"], True),
    ("external to LB with iTP:Local", EXTERNAL, "198.51.100.12", 80, BOTH["svc3"], True),
]
TO_CLUSTER_IP_NOT_FROM_POD = [f"{who} to ClusterIP{s}" for who in ("node", "external")
                              for s in ("", " with eTP:Local", " with iTP:Local")]
POD_TO_CLUSTER_IP = [f"pod to ClusterIP{s}" for s in ("", " with eTP:Local", " with iTP:Local")]
NO_SHORT_CIRCUIT = {"pod to NodePort with eTP:Local": ONLY_LOCAL["svc2"], "pod to LB with eTP:Local": ONLY_LOCAL["svc2"]}
# kube-proxy's four configurations: (masqueradeAll, detector, masq overrides, output overrides)
CONFIGS: dict[str, tuple[bool, LocalDetector, dict[str, bool], dict[str, str]]] = {
    "base": (False, DETECTOR, {}, {}),
    "no LocalTrafficDetector": (False, LocalDetector(), dict.fromkeys(TO_CLUSTER_IP_NOT_FROM_POD, False), NO_SHORT_CIRCUIT),
    "masqueradeAll": (True, DETECTOR, dict.fromkeys(POD_TO_CLUSTER_IP, True), {}),
    "masqueradeAll, no LocalTrafficDetector": (True, LocalDetector(), dict.fromkeys(POD_TO_CLUSTER_IP, True),
                                               NO_SHORT_CIRCUIT),
}


def services() -> dict[Any, Any]:
    out = {}
    for name, vip, node_port, lb, kw, local, remote in SERVICES:
        name_ = spn(name, "p80", ns="ns1")
        eps = [ep(local, 80, node_name="node"), ep(remote, 80, node_name="remote")]
        out[name_] = state(name_, vip, 80, eps, node_port=node_port, service_type="LoadBalancer",
                           load_balancer_ips=(ipaddress.ip_address(lb),), **kw)
    return out


async def datapath(masquerade_all: bool, detector: LocalDetector) -> tuple[FakeNft, NftablesDatapath]:
    fake = FakeNft()
    dp = NftablesDatapath(FakeNftClient(fake), NoConntrack(),
                          node=NodeFacts("node", detector=detector, masquerade_all=masquerade_all))
    await dp.apply(services())
    return fake, dp


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_internal_external_masquerade_as_kube_proxy(config: str) -> None:
    masquerade_all, detector, masq_over, out_over = CONFIGS[config]
    fake, _ = await datapath(masquerade_all, detector)
    wrong = []
    for name, src, dst, port, output, masq in FLOWS:
        want_eps, want_masq = set(out_over.get(name, output).split(", ")), masq_over.get(name, masq)
        got = trace(fake, 4, src, dst, "tcp", port, local=LOCAL)
        if got.verdict != "dnat" or set(got.targets) != want_eps or got.masq != (got.targets if want_masq else frozenset()):
            wrong.append(f"{name}: {got}")
    assert not wrong, "\n".join(wrong)


async def test_no_local_endpoint_drops_external_traffic_but_serves_pods_and_the_node() -> None:
    """kube-proxy TestExternalTrafficPolicyLocal-like: eTP Local with only remote endpoints."""
    name = spn("svc2", "p80", ns="ns1")
    st = state(name, "172.30.0.42", 80, [ep("10.180.1.2", 80, node_name="remote")], node_port=3002,
               service_type="LoadBalancer", load_balancer_ips=(ipaddress.ip_address("198.51.100.8"),),
               external_traffic_policy="Local")
    fake = FakeNft()
    dp = NftablesDatapath(FakeNftClient(fake), NoConntrack(), node=NodeFacts("node", detector=DETECTOR))
    await dp.apply({name: st})
    assert trace(fake, 4, EXTERNAL, NODE_IP, "tcp", 3002, local=LOCAL).verdict == "drop"
    assert trace(fake, 4, EXTERNAL, "198.51.100.8", "tcp", 80, local=LOCAL).verdict == "drop"
    pod = trace(fake, 4, POD, "198.51.100.8", "tcp", 80, local=LOCAL)
    node = trace(fake, 4, NODE_IP, NODE_IP, "tcp", 3002, local=LOCAL)
    assert pod.targets == node.targets == node.masq == {"10.180.1.2:80"} and not pod.masq


async def test_internal_policy_local_without_local_endpoint_drops() -> None:
    """kube-proxy: iTP Local, endpoints only elsewhere: ClusterIP traffic is dropped, not rejected."""
    name = spn("svc3", "p80", ns="ns1")
    st = state(name, "172.30.0.43", 80, [ep("10.180.1.3", 80, node_name="remote")], internal_traffic_policy="Local")
    fake = FakeNft()
    dp = NftablesDatapath(FakeNftClient(fake), NoConntrack(), node=NodeFacts("node", detector=DETECTOR))
    await dp.apply({name: st})
    assert trace(fake, 4, POD, "172.30.0.43", "tcp", 80, local=LOCAL).verdict == "drop"
    await dp.apply({name: state(name, "172.30.0.43", 80, [], internal_traffic_policy="Local")})
    assert trace(fake, 4, POD, "172.30.0.43", "tcp", 80, local=LOCAL).verdict == "reject"  # no endpoint anywhere


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_read_back_rebuilds_the_same_rules(config: str) -> None:
    masquerade_all, detector, _, _ = CONFIGS[config]
    fake, dp = await datapath(masquerade_all, detector)
    again = NftablesDatapath(FakeNftClient(fake), NoConntrack(),
                             node=NodeFacts("node", detector=detector, masquerade_all=masquerade_all))
    await again.read_back()
    assert again.tables[4].rules == dp.tables[4].rules
    assert read_table(4, await FakeNftClient(fake).list_table("ip", "usproxy")).groups == dp.tables[4].groups
    before = fake.dump()
    await again.apply(services())
    assert fake.dump() == before


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_node_process_with_a_service_address_as_its_source_is_masqueraded(config: str) -> None:
    """A process on the node that connects to a ClusterIP or LB IP without binding gets that
    address as its source (it is local on the ClusterIP interface): masqueraded whatever the
    configuration, as kube-proxy's IPVS mode, so an endpoint on another node sees the node's
    address. The same connection bound to the node's address is as kube-proxy has it (not
    masqueraded without a detector)."""
    masquerade_all, detector, masq_over, _ = CONFIGS[config]
    fake, _ = await datapath(masquerade_all, detector)
    for vip in ("172.30.0.41", "198.51.100.4"):
        got = trace(fake, 4, vip, vip, "tcp", 80, local=LOCAL + [vip], output=True)
        assert got.verdict == "dnat" and got.masq == got.targets == set(BOTH["svc1"].split(", ")), (vip, got)
    bound = trace(fake, 4, NODE_IP, "172.30.0.41", "tcp", 80, local=LOCAL, output=True)
    assert bool(bound.masq) == masq_over.get("node to ClusterIP", True), bound
