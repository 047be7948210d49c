"""resolve_node: the node name from --hostname-override, else NODE_NAME, else (Kubernetes source
only) the lower-cased hostname; --nodeport-addresses parsed once, a bad CIDR a ConfigError."""

from __future__ import annotations

import ipaddress

import pytest

from usproxy.config import ProxyConfig
from usproxy.errors import ConfigError
from usproxy.node import NodeFacts, resolve_node


def host() -> str:
    return "Worker-7.Example"


def test_name_from_override_then_environment_then_hostname() -> None:
    cfg = ProxyConfig()
    assert resolve_node(cfg, kubernetes=True, environ={}, hostname=host).name == "worker-7.example"
    assert resolve_node(cfg, kubernetes=True, environ={"NODE_NAME": "from-env"}, hostname=host).name == "from-env"
    flagged = ProxyConfig(hostname_override="flag")
    assert resolve_node(flagged, kubernetes=True, environ={"NODE_NAME": "from-env"}, hostname=host).name == "flag"


def test_static_source_without_a_name_knows_no_node() -> None:
    assert resolve_node(ProxyConfig(), kubernetes=False, environ={}, hostname=host) == NodeFacts(None, ())
    assert resolve_node(ProxyConfig(), kubernetes=False, environ={"NODE_NAME": "n"}, hostname=host).name == "n"


def test_nodeport_addresses_parse_once_and_bad_ones_are_config_errors() -> None:
    cfg = ProxyConfig(nodeport_addresses=("192.0.2.0/24", "2001:db8::1/64"))
    facts = resolve_node(cfg, kubernetes=False, environ={})
    assert facts.nodeport_cidrs == (ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("2001:db8::/64"))
    with pytest.raises(ConfigError, match="--nodeport-addresses"):
        resolve_node(ProxyConfig(nodeport_addresses=("primary",)), kubernetes=False, environ={})
