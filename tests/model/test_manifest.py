"""Parsing Services and EndpointSlices from kubectl output: every Service type, skips, multi-slice
merging, dual-stack, named targetPorts, unset conditions, JSON, and errors naming object and field
(with hypothesis fuzzing: garbled input gives ConfigError, never a crash)."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.fixtures import KUBECTL_OUTPUT
from usproxy.core.endpoint_slice_cache import EndpointSliceCache
from usproxy.util.errors import ConfigError
from usproxy.model.manifest import objects_from, parse_documents
from usproxy.model.types import NamespacedName, ServicePortName

WEB_HTTP = ServicePortName("default", "web", "http", "TCP")


def load() -> Any:
    return objects_from(parse_documents(KUBECTL_OUTPUT))


def test_kubectl_list_loads_unchanged() -> None:
    m = load()
    assert m.errors == []
    assert set(m.services) == {NamespacedName("default", "web"), NamespacedName("shop", "lb"),
                               NamespacedName("kube-system", "kube-dns")}
    assert len(m.slices) == 5


def test_skips_headless_externalname_and_other_proxies() -> None:
    skipped = " ".join(load().skipped)
    assert "default/headless: headless" in skipped
    assert "default/ext: type ExternalName" in skipped
    assert "service-proxy-name=somebody-else" in skipped


def test_nodeport_service_ports() -> None:
    web = load().services[NamespacedName("default", "web")]
    sp = web.ports[WEB_HTTP]
    assert (sp.port, sp.node_port, sp.target_port, sp.service_type) == (80, 30080, "http", "NodePort")
    assert sp.cluster_ips == (ipaddress.ip_address("10.96.10.10"),)
    assert sp.session_affinity == "None" and sp.affinity_timeout == 10800


def test_loadbalancer_dual_stack_affinity_and_external_ips() -> None:
    lb = load().services[NamespacedName("shop", "lb")]
    sp = lb.ports[ServicePortName("shop", "lb", "", "TCP")]
    assert [str(ip) for ip in sp.cluster_ips] == ["10.96.20.1", "fd00:96::14"]
    assert [str(ip) for ip in sp.external_ips] == ["203.0.113.7"]
    assert [str(ip) for ip in sp.load_balancer_ips] == ["198.51.100.20"]
    assert (sp.session_affinity, sp.affinity_timeout, sp.external_traffic_policy) == ("ClientIP", 600, "Local")


def test_same_port_number_tcp_and_udp_are_two_service_ports() -> None:
    dns = load().services[NamespacedName("kube-system", "kube-dns")]
    assert {(p.port, p.protocol) for p in dns.ports} == {("dns", "UDP"), ("dns-tcp", "TCP")}


def test_multi_slice_merge_named_target_port_and_conditions() -> None:
    cache = EndpointSliceCache()
    for es in load().slices.values():
        cache.apply(None, es)
    eps = cache.endpoints_for(NamespacedName("default", "web"))[WEB_HTTP]
    by_ip = {str(e.ip): e for e in eps}
    assert set(by_ip) == {"10.244.1.10", "10.244.2.10", "10.244.3.10"}
    assert all(e.port == 8080 for e in eps)  # targetPort "http" resolved by the slice
    assert (by_ip["10.244.2.10"].ready, by_ip["10.244.2.10"].serving, by_ip["10.244.2.10"].terminating) == (False, True, True)
    unset = by_ip["10.244.3.10"]  # conditions {}: ready and serving default to true
    assert (unset.ready, unset.serving, unset.terminating) == (True, True, False)


def test_dual_stack_slices_merge_per_family() -> None:
    cache = EndpointSliceCache()
    for es in load().slices.values():
        cache.apply(None, es)
    eps = cache.endpoints_for(NamespacedName("shop", "lb"))[ServicePortName("shop", "lb", "", "TCP")]
    assert sorted(str(e.ip) for e in eps) == ["10.244.5.5", "fd00:244::5"]


def test_json_input_loads_like_yaml() -> None:
    as_json = json.dumps(yaml.safe_load(KUBECTL_OUTPUT))
    assert set(objects_from(parse_documents(as_json)).services) == set(load().services)


def test_multi_document_yaml() -> None:
    docs = yaml.safe_load(KUBECTL_OUTPUT)["items"]
    text = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    assert len(objects_from(parse_documents(text)).slices) == 5


BAD_CASES = [
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 0}]}}, "Service default/x: spec.ports[0].port: must be between 1 and 65535, got 0"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80, "protocol": "ICMP"}]}}, "spec.ports[0].protocol: must be one of TCP, UDP, SCTP"),
    ({"spec": {"clusterIP": "10.96.0.999", "ports": [{"port": 80}]}}, "spec.clusterIPs[0]: not a valid IP address"),
    ({"spec": {"ports": [{"port": 80}]}}, "spec.clusterIP: required"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}, {"port": 81}]}}, "spec.ports[0].name: required when a Service has more than one port"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}], "sessionAffinity": "Cookie"}}, "spec.sessionAffinity: must be one of None, ClientIP"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}], "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}},
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds: must be between 1 and 86400"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": "80"}}, "spec.ports: must be a list"),
    ({"spec": {"clusterIP": "127.0.0.1", "ports": [{"port": 80}]}}, "spec.clusterIPs[0]: 127.0.0.1 is a loopback address"),
    ({"spec": {"clusterIP": "0.0.0.0", "ports": [{"port": 80}]}}, "spec.clusterIPs[0]: 0.0.0.0 is a unspecified address"),
    ({"spec": {"clusterIP": "10.96.0.1", "externalIPs": ["224.0.0.1"], "ports": [{"port": 80}]}}, "spec.externalIPs[0]: 224.0.0.1 is a multicast"),
    ({"spec": {"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.2"], "ports": [{"port": 80}]}}, "spec.clusterIP: 10.96.0.1 differs from clusterIPs[0]"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80, "targetPort": "99999"}]}}, "spec.ports[0].targetPort: must be between 1 and 65535"),
    ({"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80, "targetPort": "\u0668\u0660"}]}}, "spec.ports[0].targetPort: must be a port number or an IANA port name"),
    ({"metadata": "x"}, "metadata: must be an object"),
]


@pytest.mark.parametrize("body,message", BAD_CASES)
def test_bad_service_is_reported_by_object_and_field_and_skipped(body: dict[str, Any], message: str) -> None:
    good = {"kind": "Service", "metadata": {"name": "ok"}, "spec": {"clusterIP": "10.96.0.2", "ports": [{"port": 80}]}}
    bad = {"kind": "Service", "metadata": {"name": "x"}, **body}
    m = objects_from([bad, good])
    assert [str(e) for e in m.errors][0].startswith("Service default/")
    assert message in str(m.errors[0])
    assert NamespacedName("default", "ok") in m.services  # the other Service is unaffected


def test_refused_endpoint_addresses_are_dropped() -> None:
    es = {"kind": "EndpointSlice", "addressType": "IPv4",
          "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "x"}},
          "ports": [{"port": 80}],
          "endpoints": [{"addresses": [a]} for a in ("127.0.0.1", "169.254.1.1", "224.0.0.1", "0.0.0.0", "10.244.1.1")]}
    m = objects_from([es])
    eps = m.slices[NamespacedName("default", "s")].endpoints[ServicePortName("default", "x", "", "TCP")]
    assert [str(e.ip) for e in eps] == ["10.244.1.1"]


def test_slice_without_service_label_is_an_error() -> None:
    m = objects_from([{"kind": "EndpointSlice", "metadata": {"name": "s"}, "endpoints": []}])
    assert "EndpointSlice default/s: metadata.labels[kubernetes.io/service-name]: required" in str(m.errors[0])


def test_unparsable_text_raises_config_error_naming_source() -> None:
    with pytest.raises(ConfigError, match="^f.yaml: cannot parse"):
        parse_documents("kind: Service\n  bad: [", "f.yaml")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-70000, 70000) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["Service", "EndpointSlice", "List"]), body=st.dictionaries(
    st.sampled_from(["metadata", "spec", "status", "ports", "endpoints", "addressType", "items"]),
    json_values, max_size=5))
def test_fuzzed_objects_give_config_errors_never_crashes(kind: str, body: dict[str, Any]) -> None:
    try:
        m = objects_from(parse_documents(json.dumps({"kind": kind, **body})))
    except ConfigError:
        return
    for err in m.errors:
        assert isinstance(err, ConfigError) and str(err)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_fuzzed_text_gives_config_error_or_objects(text: str) -> None:
    try:
        objects_from(parse_documents(text))
    except ConfigError as err:
        assert str(err).startswith("<input>")


@pytest.mark.parametrize("text,why", [
    ("kind: List\nitems: &x [*x]\n", "refers to itself"),
    ("a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join(["*" + chr(97 + i)] * 10) + "]\n" for i in range(8)),
     "expand to more than"),
])
def test_harmful_yaml_aliases_are_refused(text: str, why: str) -> None:
    """A cycle, or a few hundred bytes that expand into 10^9 nodes: refused at once."""
    with pytest.raises(ConfigError, match=why):
        parse_documents(text)


def test_harmless_aliases_as_yaml_emitters_write_them_are_accepted() -> None:
    ports = [{"name": "http", "port": 8080}]
    text = yaml.safe_dump({"kind": "List", "items": [
        {"kind": "EndpointSlice", "metadata": {"name": n, "labels": {"kubernetes.io/service-name": n}},
         "ports": ports, "endpoints": [{"addresses": ["10.244.1.1"]}]} for n in ("a", "b")]})
    assert "&id001" in text
    assert len(objects_from(parse_documents(text)).slices) == 2


def test_lists_do_not_nest_and_flow_style_yaml_parses() -> None:
    with pytest.raises(ConfigError, match="item 0: expected an object, got list"):
        parse_documents("kind: List\nitems: [[[{kind: Service}]]]\n")
    assert parse_documents("{kind: Service, metadata: {name: x}}") == [{"kind": "Service", "metadata": {"name": "x"}}]


def test_hidden_directories_are_not_walked(tmp_path: Path) -> None:
    from usproxy.model.manifest import manifest_files

    (tmp_path / "..2026_11_30").mkdir()
    (tmp_path / "..2026_11_30" / "svc.yaml").write_text("kind: List\n")
    (tmp_path / "svc.yaml").symlink_to(tmp_path / "..2026_11_30" / "svc.yaml")
    (tmp_path / ".editor.yaml").write_text("x")
    assert manifest_files(tmp_path) == [tmp_path / "svc.yaml"]


def test_slice_over_the_api_servers_endpoint_limit_is_refused_alone() -> None:
    def es(name: str, n: int) -> dict[str, Any]:
        return {"kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "x"}},
                "ports": [{"port": 80}],
                "endpoints": [{"addresses": [f"10.1.{i // 256}.{i % 256}"]} for i in range(n)]}
    m = objects_from([es("big", 1001), es("full", 1000)])
    assert [str(e) for e in m.errors] == [
        "EndpointSlice default/big: endpoints: must have at most 1000 items, got 1001"]
    eps = m.slices[NamespacedName("default", "full")].endpoints[ServicePortName("default", "x", "", "TCP")]
    assert len(eps) == 1000  # the slice at the limit, beside the refused one, is served whole


def test_slice_over_the_api_servers_port_limit_is_refused() -> None:
    es = {"kind": "EndpointSlice", "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "x"}},
          "ports": [{"name": f"p{i}", "port": 1000 + i} for i in range(101)],
          "endpoints": [{"addresses": ["10.1.1.1"]}]}
    assert [str(e) for e in objects_from([es]).errors] == [
        "EndpointSlice default/s: ports: must have at most 100 items, got 101"]
