"""The model shares repeated strings (usproxy/model/fields.py): the memory of 10,000 Services."""

from __future__ import annotations

import json
from typing import Any, cast

from usproxy.model.endpoint_slice import parse_endpoint_slice
from usproxy.model.service import parse_service


def decoded(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as a JSON decode gives it: every string a new object."""
    return cast(dict[str, Any], json.loads(json.dumps(obj)))


def service(name: str, ip: str) -> dict[str, Any]:
    return decoded({"metadata": {"name": name, "namespace": "default"},
                    "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})


def endpoint_slice(name: str, service_name: str, ips: list[str]) -> dict[str, Any]:
    return decoded({"metadata": {"name": name, "namespace": "default",
                                 "labels": {"kubernetes.io/service-name": service_name}},
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": "node-a",
                                   "zone": "zone-a"} for ip in ips],
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})


def test_repeated_strings_of_separately_decoded_objects_are_shared() -> None:
    """Each decode gives every occurrence of "default", "ClusterIP" or a node's name its own
    string; the model keeps one of each, and a slice's Service name is the Service's own."""
    a, b = parse_service(service("web", "10.96.0.1")), parse_service(service("db", "10.96.0.2"))
    sl = parse_endpoint_slice(endpoint_slice("web-1", "web", ["10.244.1.1", "10.244.1.2"]))
    pa, pb = next(iter(a.ports.values())), next(iter(b.ports.values()))
    assert a.name.namespace is b.name.namespace is sl.name.namespace
    assert pa.service_type is pb.service_type and pa.session_affinity is pb.session_affinity
    assert pa.name.port is pb.name.port
    assert sl.service.name is a.name.name
    endpoints = [e for eps in sl.endpoints.values() for e in eps]
    assert len(endpoints) == 2
    assert endpoints[0].node_name is endpoints[1].node_name == "node-a"
    assert endpoints[0].zone is endpoints[1].zone == "zone-a"
