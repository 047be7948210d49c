"""ClientOrigin: which clients the relay takes for pods or the node itself (kube-proxy's
local-traffic detector and `fib saddr type local`), without a network namespace: by detector CIDR
per family, by the node's own addresses, by the route back (a loopback address is the node's),
and the socket filter clause that lets the same clients through."""

from __future__ import annotations

import ipaddress

from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.types import IPAddress
from usproxy.relay.client_origin import RTN_LOCAL, ClientOrigin, RouteBack
from usproxy.relay.source_filter import LOOPBACK_IFINDEX, Clause

NODE = {ipaddress.ip_address("192.0.2.10"), ipaddress.ip_address("10.96.0.10")}


def is_node(ip: IPAddress) -> bool:
    return ip in NODE


def test_cidr_detector_and_node_addresses() -> None:
    origin = ClientOrigin(local_detector("ClusterCIDR", cluster_cidrs=("10.244.0.0/16",)), is_node)
    assert origin.internal("10.244.3.7")  # a pod
    assert origin.internal("192.0.2.10") and origin.internal("10.96.0.10")  # the node, usproxy0 included
    assert not origin.internal("203.0.113.2")
    assert not origin.internal("2001:db8::5")  # no IPv6 CIDR: no IPv6 pod is detected
    assert not origin.internal("not-an-address")
    assert origin.clause(4) == Clause(tuple(origin.detector.cidrs), (LOOPBACK_IFINDEX,))
    assert origin.clause(6) == Clause((), (LOOPBACK_IFINDEX,))  # the node only


def test_no_detector_still_knows_the_node() -> None:
    origin = ClientOrigin(LocalDetector(), is_node)
    assert origin.internal("192.0.2.10") and not origin.internal("10.244.3.7")
    assert origin.refresh() is False  # nothing to read for a CIDR or no-op detector


def test_interface_detector_takes_the_route_back() -> None:
    origin = ClientOrigin(local_detector("BridgeInterface", bridge="lo"), lambda ip: False)
    try:
        assert origin.internal("127.0.0.1")  # routed back through lo, and local
        assert origin.refresh() is True and origin.ifindexes == (LOOPBACK_IFINDEX,)
        assert origin.refresh() is False
        assert origin.clause(4) == Clause((), (LOOPBACK_IFINDEX, LOOPBACK_IFINDEX))
    finally:
        origin.close()


def test_route_back_says_local_for_loopback() -> None:
    route = RouteBack()
    try:
        kind, oif = route.lookup(ipaddress.ip_address("127.0.0.1"))
        assert (kind, oif) == (RTN_LOCAL, LOOPBACK_IFINDEX)
    finally:
        route.close()
