"""Chain names hashed exactly as kube-proxy hashes them, checked against names from kube-proxy's
own tests (pkg/proxy/iptables/proxier_test.go TestOverallIPTablesRules and
pkg/proxy/nftables/proxier_test.go TestOverallNFTablesRules)."""

from __future__ import annotations

import ipaddress

import pytest

from usproxy.model.endpoint import Endpoint
from usproxy.model import chain_names as names
from usproxy.model.types import ServicePortName


def spn(ns: str, name: str, port: str = "p80") -> ServicePortName:
    return ServicePortName(ns, name, port, "TCP")


def ep(ip: str, port: int = 80) -> Endpoint:
    return Endpoint(ipaddress.ip_address(ip), port)


@pytest.mark.parametrize(("ns", "name", "chain"), [
    ("ns1", "svc1", "XPGD46QRK7WJZT7O"),
    ("ns2", "svc2", "GNZBNJ2PO5MGZ6GT"),
    ("ns3", "svc3", "X27LE4BHSL4DOUIK"),
    ("ns4", "svc4", "4SW47YFZTEDKD3PK"),
    ("ns5", "svc5", "NUKIZ6OKUXPJNT4C"),
])
def test_iptables_service_chains(ns: str, name: str, chain: str) -> None:
    s = spn(ns, name)
    assert names.svc_chain(s) == f"KUBE-SVC-{chain}"
    assert names.ext_chain(s) == f"KUBE-EXT-{chain}"
    assert names.svl_chain(s) == f"KUBE-SVL-{chain}"


@pytest.mark.parametrize(("ns", "name", "ip", "chain"), [
    ("ns1", "svc1", "10.180.0.1", "KUBE-SEP-SXIVWICOYRO3J4NJ"),
    ("ns2", "svc2", "10.180.0.2", "KUBE-SEP-RS4RBKLTHTF2IUXJ"),
    ("ns3", "svc3", "10.180.0.3", "KUBE-SEP-OYPFS5VJICHGATKP"),
    ("ns4", "svc4", "10.180.0.4", "KUBE-SEP-UKSFD7AGPMPPLUHC"),
    ("ns4", "svc4", "10.180.0.5", "KUBE-SEP-C6EBXVWJJZMIWKLZ"),
    ("ns5", "svc5", "10.180.0.3", "KUBE-SEP-I77PXRDZVX7PMWMN"),
])
def test_iptables_endpoint_chains(ns: str, name: str, ip: str, chain: str) -> None:
    assert names.sep_chain(spn(ns, name), ep(ip)) == chain


@pytest.mark.parametrize(("ns", "name", "base"), [
    ("ns1", "svc1", "ULMVA6XW-ns1/svc1/tcp/p80"),
    ("ns2", "svc2", "42NFTM6N-ns2/svc2/tcp/p80"),
    ("ns3", "svc3", "4AT6LBPK-ns3/svc3/tcp/p80"),
    ("ns4", "svc4", "LAUZTJTB-ns4/svc4/tcp/p80"),
    ("ns5", "svc5", "HVFWP5L3-ns5/svc5/tcp/p80"),
])
def test_nftables_service_chain_base(ns: str, name: str, base: str) -> None:
    assert names.nft_base(spn(ns, name)) == base


@pytest.mark.parametrize(("ns", "name", "ip", "base"), [
    ("ns1", "svc1", "10.180.0.1", "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"),
    ("ns2", "svc2", "10.180.0.2", "SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80"),
    ("ns3", "svc3", "10.180.0.3", "UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80"),
    ("ns4", "svc4", "10.180.0.4", "UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80"),
    ("ns4", "svc4", "10.180.0.5", "5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80"),
    ("ns5", "svc5", "10.180.0.3", "GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80"),
])
def test_nftables_endpoint_chain_base(ns: str, name: str, ip: str, base: str) -> None:
    assert names.nft_endpoint_base(spn(ns, name), ep(ip)) == base


def test_protocol_is_part_of_the_hash() -> None:
    tcp, udp = ServicePortName("kube-system", "dns", "dns", "TCP"), ServicePortName("kube-system", "dns", "dns", "UDP")
    assert names.svc_chain(tcp) != names.svc_chain(udp)
    assert names.nft_base(udp).endswith("-kube-system/dns/udp/dns")


def test_ipv6_endpoint_colons_become_dots_and_names_stay_short() -> None:
    base = names.nft_endpoint_base(spn("ns", "svc"), ep("fd00:10:244::6:1", 8080))
    assert base.endswith("-ns/svc/tcp/p80__fd00.10.244..6.1/8080")
    long = ServicePortName("n" * 63, "s" * 63, "p" * 15, "TCP")
    v6 = ep("fd00:1111:2222:3333:4444:5555:6666:7777", 65535)
    assert len(names.nft_endpoint_base(long, v6)) <= names.NFT_BASE_MAX
    assert len(names.svc_chain(long)) <= 28  # iptables' chain-name limit
