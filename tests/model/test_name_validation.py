"""Class "nftables command injection" (issue 18, item 4): a name from a manifest or a hostile API
server with a quote, tabs and newlines once created `table ip pwned` and a foreign `service-ips`
element, and forged log lines. Names are validated as the API server does (refused naming object
and field, the other objects kept), and an nft comment cannot leave its quotes whatever reaches
the nftables layer. The same text run by a real `nft` is tests/offload/test_nftables_command_injection.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.model.hostile import HOSTILE
from usproxy.util.errors import ConfigError
from usproxy.model.fields import describe
from usproxy.model.manifest import objects_from, parse_documents
from usproxy.offload.nftables.commands import Command, Elem, render
from usproxy.offload.nftables.names import comment_of, parse_comment
from usproxy.model.types import NamespacedName, ServicePortName


def service(name: str = "web", namespace: str = "default", port_name: str = "http") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": "10.96.0.10",
                     "ports": [{"name": port_name, "port": 80}, {"name": "b", "port": 81}]}}


def endpoint_slice(name: str = "web-1", service_name: str = "web", port_name: str = "http") -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": service_name}},
            "endpoints": [{"addresses": ["10.1.0.1"]}], "ports": [{"name": port_name, "port": 8080}]}


def loaded(*objs: dict[str, Any]) -> Any:
    return objects_from(parse_documents(json.dumps({"kind": "List", "items": list(objs)})))


@pytest.mark.parametrize(("obj", "field"), [
    (service(name=HOSTILE), "metadata.name"),
    (service(namespace=HOSTILE), "metadata.namespace"),
    (service(port_name=HOSTILE), "spec.ports[0].name"),
    (endpoint_slice(name=HOSTILE), "metadata.name"),
    (endpoint_slice(service_name=HOSTILE), "metadata.labels[kubernetes.io/service-name]"),
    (endpoint_slice(port_name=HOSTILE), "ports[0].name"),
])
def test_command_injection_hostile_name_refused_naming_the_field(obj: dict[str, Any], field: str) -> None:
    good = service(name="good")
    m = loaded(obj, good)
    assert [e.field for e in m.errors] == [field]
    message = str(m.errors[0])
    assert "\n" not in message and "\t" not in message  # one log line, the name shown quoted
    assert NamespacedName("default", "good") in m.services  # the others keep working
    assert NamespacedName("default", HOSTILE) not in m.services and not m.slices


@pytest.mark.parametrize("name", ["a" * 64, "Web", "web_1", "-web", "web-", "", "we.b"])
def test_command_injection_service_names_follow_dns1123_label(name: str) -> None:
    m = loaded(service(name=name))
    assert not m.services and m.errors and m.errors[0].field == "metadata.name"


def test_command_injection_valid_names_still_accepted() -> None:
    m = loaded(service(name="a" * 63, namespace="kube-system", port_name="dns-tcp-" + "x" * 20),
               endpoint_slice(name="web.v1-abc12", service_name="a" * 63, port_name="dns-tcp-" + "x" * 20))
    assert m.errors == [] and len(m.services) == 1 and len(m.slices) == 1


def test_command_injection_describe_quotes_an_unsafe_name() -> None:
    text = describe("Service", {"metadata": {"name": HOSTILE, "namespace": "default"}})
    assert text == f"Service default/{HOSTILE!r}" and "\n" not in text
    assert describe("Service", {"metadata": {"name": "web"}}) == "Service default/web"
    err = ConfigError("bad", obj=text, field="metadata.name")
    assert "\n" not in str(err)


def test_command_injection_comment_cannot_leave_its_quotes() -> None:
    spn = ServicePortName("default", HOSTILE, "http", "TCP")
    elem = Elem("10.96.0.10 . tcp . 80", "goto g-1", comment_of(spn, "cluster"))
    raw = Elem("10.96.0.11 . tcp . 80", "goto g-1", HOSTILE)  # a comment that skipped comment_of
    text = render([Command("add", "element", 4, "service-ips", elems=(elem, raw))])
    assert text.count("\n") == 1  # one command, one line
    assert text.count('"') == 4  # each comment opens and closes its quotes, nothing else
    assert "pwned" in text  # still there, but only inside a comment:
    for part in text.split('"')[1::2]:
        assert all(c.isalnum() or c in "._:/ -" for c in part), part
    assert 'comment "' + comment_of(spn, "cluster") + '"' in text
    assert Elem("k", None, HOSTILE).nft().count('"') == 2


def test_command_injection_comment_of_a_valid_name_reads_back() -> None:
    spn = ServicePortName("kube-system", "kube-dns", "dns-tcp", "TCP")
    assert parse_comment(comment_of(spn, "external")) == (spn, "external")
