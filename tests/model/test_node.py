"""resolve_node: the node name from --hostname-override, else NODE_NAME, else (Kubernetes source
only) the lower-cased hostname; --nodeport-addresses parsed once, a bad CIDR a ConfigError,
"primary" the node's primary addresses; NodeFacts.nodeport_ips picks NodePort addresses per IP
family as kube-proxy's NodePortAddresses (pkg/proxy/util/nodeport_addresses.go)."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from usproxy.model.config import ProxyConfig
from usproxy.util.errors import ConfigError
from usproxy.model.node import LocalAddresses, NodeFacts, resolve_node, watch_nodeport_addresses
from usproxy.model.types import IPAddress


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
    for bad in (("primary-ish",), ("192.0.2.1",), ("primary", "192.0.2.0/24"), ("10.0.0.0/33",)):
        with pytest.raises(ConfigError, match="--nodeport-addresses"):
            resolve_node(ProxyConfig(nodeport_addresses=bad), kubernetes=False, environ={})


def test_primary_is_the_primary_address_of_each_family() -> None:
    cfg = ProxyConfig(nodeport_addresses=("primary",))
    both = resolve_node(cfg, kubernetes=False, environ={}, primary=lambda: (ip("192.0.2.10"), ip("2001:db8::10")))
    assert both.nodeport_cidrs == (ipaddress.ip_network("192.0.2.10/32"), ipaddress.ip_network("2001:db8::10/128"))
    v4 = resolve_node(cfg, kubernetes=False, environ={}, primary=lambda: (ip("127.0.0.1"), ip("192.0.2.10")))
    assert v4.nodeport_cidrs == (ipaddress.ip_network("192.0.2.10/32"),)  # loopback is never primary
    assert not v4.nodeport_match_all(4) and v4.nodeport_match_all(6)  # kube-proxy: no IPv6 CIDR, every address


LOCAL = [("lo", "127.0.0.1"), ("eth0", "192.0.2.10"), ("eth0", "192.0.2.11"), ("eth1", "198.51.100.7"),
         ("eth0", "2001:db8::10"), ("eth0", "fe80::1"), ("usproxy0", "10.96.0.1"), ("lo", "::1"),
         ("kube-ipvs0", "10.96.0.1"), ("kube-ipvs0", "10.96.0.2")]  # the IPVS datapath's: Service addresses too


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def picked(facts: NodeFacts) -> list[str]:
    return [str(a) for a in facts.nodeport_ips([(n, ip(a)) for n, a in LOCAL], "usproxy0")]


def test_nodeport_ips_default_every_address_but_loopback_link_local_and_clusterips() -> None:
    assert picked(NodeFacts()) == ["192.0.2.10", "192.0.2.11", "198.51.100.7", "2001:db8::10"]


def test_nodeport_ips_cidrs_apply_per_family() -> None:
    one = NodeFacts(nodeport_cidrs=(ipaddress.ip_network("192.0.2.10/32"),))
    assert picked(one) == ["192.0.2.10", "2001:db8::10"]  # no IPv6 CIDR: every IPv6 address
    both = NodeFacts(nodeport_cidrs=(ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("2001:db8:1::/48")))
    assert picked(both) == ["198.51.100.7"]
    loop = NodeFacts(nodeport_cidrs=(ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.96.0.0/16")))
    assert picked(loop) == ["2001:db8::10"]  # never loopback nor the ClusterIP interface
    zero = NodeFacts(nodeport_cidrs=(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("2001:db8::/32")))
    assert zero.nodeport_match_all(4) and not zero.nodeport_match_all(6)


async def test_watch_calls_back_once_per_change_of_the_nodeport_addresses() -> None:
    facts = NodeFacts(nodeport_cidrs=(ipaddress.ip_network("192.0.2.0/24"),))
    a, c = [("eth0", ip("192.0.2.10"))], [("eth0", ip("192.0.2.11"))]
    outside = [*a, ("eth1", ip("198.51.100.7"))]  # not admitted: no change
    outcomes: list[LocalAddresses | Exception] = [a, outside, c, OSError("netlink went away"), c]
    calls: list[int] = []
    done = asyncio.Event()

    def read() -> LocalAddresses:
        if not outcomes:
            done.set()
            return c
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item  # logged, retried: the watch goes on
        return item

    task = asyncio.create_task(watch_nodeport_addresses(facts, "usproxy0", lambda: calls.append(1), interval=0.01, read=read))
    await asyncio.wait_for(done.wait(), 5)
    assert not task.done()
    task.cancel()
    assert calls == [1]  # 192.0.2.10 -> 192.0.2.11, once


async def test_watch_awaits_an_async_callback_before_it_polls_again() -> None:
    """The agent's callback lets the BPF datapath read the addresses again before the full sync."""
    facts = NodeFacts()
    seen: list[str] = []
    reads = iter([[("eth0", ip("192.0.2.10"))], [("eth0", ip("192.0.2.11"))]])
    done = asyncio.Event()

    def read() -> LocalAddresses:
        seen.append("read")
        try:
            return next(reads)
        except StopIteration:
            done.set()
            return [("eth0", ip("192.0.2.11"))]

    async def changed() -> None:
        seen.append("changed")
        await asyncio.sleep(0.05)  # several poll intervals: no read meanwhile
        seen.append("followed")

    task = asyncio.create_task(watch_nodeport_addresses(facts, "usproxy0", changed, interval=0.01, read=read))
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    assert seen[:5] == ["read", "read", "changed", "followed", "read"], seen
