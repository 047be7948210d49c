"""Services asking for the same frontend (field: one bad Service never stops the others): a
ClusterIP beats an externalIP naming it (CVE-2020-8554) in either order, the holder of an
externalIP or NodePort keeps it, claims of one sync settle in name order, the best waiting claim
takes over when the owner lets go, and every datapath gets the same answer through the Proxier."""

from __future__ import annotations

import ipaddress
import logging

import pytest

from usproxy.core.datapath import FakeDatapath
from usproxy.core.frontend_claims import CLUSTER_IP, EXTERNAL, NODE_PORT, FrontendClaims, FrontendKey
from usproxy.core.proxier import Proxier
from usproxy.model.service import Service
from usproxy.model.service_port import ServicePort
from usproxy.model.types import NamespacedName, ServicePortName


def spn(name: str) -> ServicePortName:
    return ServicePortName("default", name, "", "TCP")


def sp(name: str, ip: str, *, ext: tuple[str, ...] = (), node_port: int = 0) -> ServicePort:
    return ServicePort(spn(name), (ipaddress.ip_address(ip),), 80, 8080, node_port=node_port,
                       service_type="NodePort" if node_port else "ClusterIP",
                       external_ips=tuple(ipaddress.ip_address(e) for e in ext))


def service(port: ServicePort) -> Service:
    return Service(NamespacedName(port.name.namespace, port.name.name), {port.name: port})


def key(ip: str | None, port: int = 80) -> FrontendKey:
    return (ipaddress.ip_address(ip) if ip else None, port, "TCP")


def test_a_clusterip_beats_an_external_ip_naming_it_whichever_came_first(caplog: pytest.LogCaptureFixture) -> None:
    c = FrontendClaims()
    assert c.update(spn("mitm"), sp("mitm", "10.96.0.9", ext=("10.96.0.1",))) == set()
    with caplog.at_level(logging.ERROR):
        assert c.update(spn("api"), sp("api", "10.96.0.1")) == {spn("mitm")}  # mitm must be re-synced
    assert c.lost(spn("api")) == {}
    assert c.lost(spn("mitm")) == {key("10.96.0.1"): EXTERNAL}
    assert "default/mitm" in caplog.text and "spec.externalIPs" in caplog.text and "10.96.0.1:80/TCP" in caplog.text


def test_the_holder_keeps_an_external_ip_and_the_waiter_takes_over_when_it_lets_go() -> None:
    c = FrontendClaims()
    c.update(spn("first"), sp("first", "10.96.0.1", ext=("192.0.2.50",)))
    c.update(spn("second"), sp("second", "10.96.0.2", ext=("192.0.2.50",)))
    assert c.lost(spn("first")) == {} and c.lost(spn("second")) == {key("192.0.2.50"): EXTERNAL}
    # an unrelated change of the holder does not hand it over
    assert c.update(spn("first"), sp("first", "10.96.0.1", ext=("192.0.2.50",), node_port=30001)) == set()
    assert c.lost(spn("first")) == {}
    assert c.update(spn("first"), None) == {spn("second")}
    assert c.lost(spn("second")) == {}


def test_duplicate_nodeports_and_clusterips() -> None:
    c = FrontendClaims()
    c.update(spn("a"), sp("a", "10.96.0.1", node_port=30080))
    c.update(spn("b"), sp("b", "10.96.0.1", node_port=30080))
    assert c.lost(spn("b")) == {key("10.96.0.1"): CLUSTER_IP, key(None, 30080): NODE_PORT}
    assert c.update(spn("a"), None) == {spn("b")}
    assert c.lost(spn("b")) == {}


def ready_proxier() -> tuple[Proxier, FakeDatapath]:
    fake = FakeDatapath()
    p = Proxier([fake])
    p.on_services_synced()
    p.on_endpoint_slices_synced()
    return p, fake


async def test_through_the_proxier_the_loser_is_served_without_the_contested_frontend() -> None:
    p, fake = ready_proxier()
    p.on_service_update(None, service(sp("zz-first", "10.96.0.2", ext=("192.0.2.50",))))
    p.on_service_update(None, service(sp("aa-second", "10.96.0.3", ext=("192.0.2.50",))))
    await p.sync()  # the same sync: settled in name order, so aa-second holds it
    assert fake.state[spn("aa-second")].service_port.external_ips == (ipaddress.ip_address("192.0.2.50"),)
    assert fake.state[spn("zz-first")].service_port.external_ips == ()
    p.on_service_update(service(sp("aa-second", "10.96.0.3", ext=("192.0.2.50",))), None)
    await p.sync()
    assert spn("aa-second") not in fake.state
    assert set(fake.syncs[-1].changes) == {spn("aa-second"), spn("zz-first")}  # the heir is re-synced
    assert fake.state[spn("zz-first")].service_port.external_ips == (ipaddress.ip_address("192.0.2.50"),)


async def test_through_the_proxier_a_duplicate_clusterip_port_is_not_served_and_says_why() -> None:
    p, fake = ready_proxier()
    p.on_service_update(None, service(sp("a", "10.96.0.1")))
    await p.sync()
    p.on_service_update(None, service(sp("b", "10.96.0.1")))
    await p.sync()
    assert spn("b") not in fake.state and spn("a") in fake.state
    assert p.placement(spn("b")).reason == "10.96.0.1:80/TCP is served by default/a"
    p.on_service_update(service(sp("a", "10.96.0.1")), None)
    await p.sync()
    assert spn("b") in fake.state


def test_an_unserved_service_port_holds_none_of_its_other_frontends() -> None:
    c = FrontendClaims()
    for name, port in (("a", sp("a", "10.96.0.1")),
                       ("b", sp("b", "10.96.0.1", node_port=30000)),  # its ClusterIP:port is a's: not served
                       ("c", sp("c", "10.96.0.3", node_port=30000))):
        c.begin()  # one sync each
        c.update(spn(name), port)
    assert c.lost(spn("c")) == {}  # the NodePort goes to a ServicePort that is served
    c.begin()
    assert c.update(spn("a"), None) == {spn("b")}  # b is served again, but c keeps the NodePort
    assert c.lost(spn("b")) == {key(None, 30000): NODE_PORT}


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_settling_does_not_depend_on_the_order_changes_arrive_in(order: tuple[str, str]) -> None:
    c = FrontendClaims()
    c.begin()
    c.update(spn("b"), sp("b", "10.96.0.2", ext=("192.0.2.50",)))
    c.update(spn("a"), sp("a", "10.96.0.1", ext=("192.0.2.50",)))
    assert c.owner_of(key("192.0.2.50")) == spn("a")  # same sync: by name
    c.begin()  # a later sync: both change, the holder keeps it whatever the order
    for n in order:
        c.update(spn(n), sp(n, f"10.96.0.{1 if n == 'a' else 2}", ext=("192.0.2.50",), node_port=30001 if n == "a" else 30002))
    assert c.owner_of(key("192.0.2.50")) == spn("a")
    c.begin()  # the holder goes and a newcomer arrives in the same sync: the smaller name wins
    steps = [("a", None), ("0", sp("0", "10.96.0.9", ext=("192.0.2.50",)))]
    for name, port in (steps if order[0] == "a" else steps[::-1]):
        c.update(spn(name), port)
    assert c.owner_of(key("192.0.2.50")) == spn("0")
