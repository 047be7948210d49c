"""The path drawings and the standalone page (`usproxy explain --html`): each mode's drawing names
kube-proxy's own chains, every mode draws where it refuses a ServicePort without endpoints, and the
page holds every Service and mode in one file with explain's own rules."""

from __future__ import annotations

import ipaddress
import re
import xml.etree.ElementTree as ET
from html import unescape
from pathlib import Path

from usproxy.explain import path_drawing, registry, standalone_page
from usproxy.model import chain_names
from usproxy.model.service_set import ServiceSet, family_port, load_manifests, service_set
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName

SVG = "{http://www.w3.org/2000/svg}"


def test_each_modes_drawing_names_its_own_chains() -> None:
    name = ServicePortName("default", "web", "http", "TCP")
    sp = ServicePort(name=name, cluster_ips=(ipaddress.ip_address("10.96.10.10"),), port=80, target_port=8080)
    eps = tuple(Endpoint(ipaddress.ip_address(ip), 8080, ready=True) for ip in ("10.244.1.5", "10.244.2.5"))
    fp = family_port(sp, eps, 4, None)
    assert fp is not None
    svgs = {m.name: path_drawing.render(m.drawing.of(fp), m.name) for m in registry.MODES}
    texts = {m: " ".join(ET.fromstring(svg).itertext()) for m, svg in svgs.items()}
    assert chain_names.svc_chain(name) in texts["iptables"]
    assert all(chain_names.sep_chain(name, e) in texts["iptables"] for e in eps)
    assert "service-" + chain_names.nft_base(name)[:9] in texts["nftables"]
    assert "numgen random mod 2" in texts["nftables"]
    assert "Masq = DNAT, not SNAT" in texts["ipvs"] and "no NAT" in texts["bpf"]
    assert "2nd connection" in texts["userspace"] and "the node's address" in texts["userspace"]
    for m, svg in svgs.items():
        root = ET.fromstring(svg)
        assert any(line.get("class") == "reply" for line in root.iter(f"{SVG}line")), m


def test_the_standalone_page_holds_every_service_and_mode_in_one_file() -> None:
    """`explain --html`'s page for examples/: one block per Service, five modes each with one
    drawing per ServicePort and explain's own rules for that Service; no script, no link out."""
    ss = service_set(load_manifests(Path(__file__).resolve().parents[2] / "examples"))
    page = standalone_page.render(ss)
    assert "<script" not in page and not re.search(r"<link|src=|https?://(?!www\.w3\.org/2000/svg)", page)
    found = re.findall(r'<details class="service" data-service="([^"]+)"( open)?>(.*?)</details>', page, re.S)
    names = sorted({f"{sp.name.namespace}/{sp.name.name}" for sp, _ in ss.ports})
    assert sorted(n for n, _, _ in found) == names and len(names) >= 2
    # the first Service shown, and the only one open, is one a connection can reach
    assert [bool(o) for _, o, _ in found] == [True] + [False] * (len(found) - 1)
    assert any(usable(eps) for sp, eps in ss.ports if str(sp.name.service) == found[0][0])
    assert found[-1][0] == "default/empty"  # examples/' Service without endpoints comes last
    blocks = [(n, b) for n, _, b in found]
    for name, block in blocks:
        ports = tuple((sp, eps) for sp, eps in ss.ports if f"{sp.name.namespace}/{sp.name.name}" == name)
        one = ServiceSet(ports, ss.node)
        modes = re.findall(r'<div class="mode" data-mode="(\w+)">(.*?)<pre class="rules">(.*?)</pre>', block, re.S)
        assert [m for m, _, _ in modes] == list(registry.NAMES)
        n_ports = sum(len(one.family_ports(f)) for f in one.families())
        for mode, drawing, rules in modes:
            assert drawing.count("<svg ") == n_ports, (name, mode)
            assert unescape(rules) == registry.by_name(mode).render(one)
    assert standalone_page.render(ServiceSet(())).count("No Services to show.") == 1


def test_without_endpoints_every_mode_draws_where_it_refuses() -> None:
    name = ServicePortName("default", "empty", "", "TCP")
    sp = ServicePort(name=name, cluster_ips=(ipaddress.ip_address("10.96.20.20"),), port=80, target_port=8080)
    fp = family_port(sp, (), 4, None)
    assert fp is not None
    ends = {m.name: m.drawing.of(fp).hops[-1] for m in registry.MODES}
    assert all(not m.drawing.of(fp).backends for m in registry.MODES)
    assert "-j REJECT" in ends["iptables"].lines and ends["nftables"].title == "no-endpoint-services"
    assert "ECONNREFUSED" in ends["bpf"].lines and "kernel answers RST" in ends["userspace"].lines
    svg = ET.fromstring(path_drawing.render(path_drawing.IPVS.of(fp), "ipvs"))
    assert "no real server:" in " ".join(svg.itertext())
