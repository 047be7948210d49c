"""kube-proxy's packet-flow tests as data (tests/explain/flows/flows.yaml): the node they run on,
its local addresses, and the Services and first packets of each test (test_flows, test_reply)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from usproxy.explain import trace
from usproxy.explain.packet import Packet
from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set

FLOWS = Path(__file__).parent / "flows"
DATA: dict[str, Any] = yaml.safe_load((FLOWS / "flows.yaml").read_text())


def _node() -> tuple[Node, frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    n = DATA["node"]
    node = Node(n["name"], tuple(ipaddress.ip_address(ip) for ip in n["nodeport_ips"]),
                (ipaddress.ip_network(n["cluster_cidr"]),), (ipaddress.ip_network(n["service_cidr"]),))
    return node, frozenset(ipaddress.ip_address(ip) for ip in n["local_ips"])


NODE, LOCAL = _node()


def flow_set(test: str) -> ServiceSet:
    return service_set(load_manifests(FLOWS / f"{test}.yaml"), NODE)


def flow_packet(ss: ServiceSet, src: str, dst: str) -> Packet:
    """As kube-proxy's tracer: every address of testNodeIPs is local, not only NodePort ones."""
    pkt = trace.parse_packet(src, dst, ss)
    return replace(pkt, src_local=pkt.src in LOCAL, dst_local=pkt.dst in LOCAL)
