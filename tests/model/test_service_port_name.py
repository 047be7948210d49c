"""ServicePortName.key() and its inverse from_key(), which both kernel datapaths use to attribute
what they read back (nftables element comments, BPF service group names)."""

from __future__ import annotations

import pytest

from usproxy.model.types import ServicePortName


@pytest.mark.parametrize("name", [ServicePortName("default", "web", "http", "TCP"),
                                  ServicePortName("kube-system", "dns", "", "UDP"),
                                  ServicePortName("ns", "s", "p", "SCTP")])
def test_round_trips_through_its_key(name: ServicePortName) -> None:
    assert ServicePortName.from_key(name.key()) == name


def test_an_unnamed_port_has_no_colon() -> None:
    assert ServicePortName("default", "web", "", "TCP").key() == "default/web/TCP"
    assert ServicePortName.from_key("default/web/TCP") == ServicePortName("default", "web", "", "TCP")


@pytest.mark.parametrize("text", ["/web:http/TCP", "default/:http/TCP", "default//TCP", "//TCP", "web/TCP",
                                  "default/web:http/ICMP", "default/web:http", "garbage", ""])
def test_text_that_names_no_service_port(text: str) -> None:
    assert ServicePortName.from_key(text) is None
