"""--nodeport-addresses and --service-cidr with real traffic through the real agent, per datapath.

The node namespace holds two addresses (192.0.2.10 and 192.0.2.11); --nodeport-addresses names
one: the NodePort answers on it and is refused on the other, in the relay and in nftables (which
served every local address until now), and an address added while the agent runs serves
NodePorts within seconds in both. --service-cidr: a new
connection to an unallocated address of the range is dropped in nftables (kube-proxy's verdict:
DROP, so the client times out) instead of being routed on to a host that answers; the relay has
no such verdict (documented: the address is routed on).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from usproxy.model.node import interface_addresses, read_local_addresses

from tests.netns import Topology, inside, nsexec
from tests.offload.agent import placement, wait_for, web
from tests.offload.harness import OFFLOAD, Pods, conntrack, nft_list, tcp_name, wait_listening
from tests.relay.harness import AgentProc, Manifests

pytestmark = pytest.mark.netns

NP = {"type": "NodePort", "port_extra": {"nodePort": 30080}}
DATAPATH_FLAGS = {"relay": (), "nftables": OFFLOAD}


@pytest.fixture
def agents(topology: Topology) -> Iterator[Callable[..., AgentProc]]:
    made: list[AgentProc] = []

    def make(m: Manifests, *flags: str) -> AgentProc:
        a = AgentProc(topology, m, "uvloop", *flags)
        made.append(a)
        return a

    try:
        yield make
    finally:
        for a in made:
            a.stop()


def serving(agent: AgentProc, datapath: str) -> None:
    want = "nftables" if datapath == "nftables" else "userspace"
    wait_for(lambda: placement(agent)[0] == want, what=f"served by {want}")


def kernel_dnat(ns: str, dst: str) -> bool:
    """Whether the node's conntrack holds a connection to dst:30080 DNATed to the endpoint."""
    return "src=10.244.1.5" in conntrack(ns, "-p", "tcp", "-d", dst, "--dport", "30080")


@pytest.mark.parametrize("datapath", ["relay", "nftables"])
def test_nodeport_answers_only_on_the_named_address(datapath: str, topology: Topology, tmp_path: Path,
                                                   pods: Pods, agents: Callable[..., AgentProc]) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"], **NP))
    agent = agents(m, "--nodeport-addresses", "192.0.2.10/32", "--sync-period", "1s", *DATAPATH_FLAGS[datapath])
    agent.start()
    serving(agent, datapath)
    assert {tcp_name(cli, "192.0.2.10", 30080) for _ in range(20)} == {"be-a"}
    for _ in range(20):
        with pytest.raises(ConnectionRefusedError):
            tcp_name(cli, "192.0.2.11", 30080)
    with pytest.raises(ConnectionRefusedError):
        tcp_name(topology.node, "192.0.2.11", 30080)  # from the node itself too
    assert tcp_name(topology.node, "192.0.2.10", 30080) == "be-a"
    if datapath == "nftables":
        assert kernel_dnat(topology.node, "192.0.2.10")  # the kernel served it, not the relay
        assert "elements = { 192.0.2.10 }" in nft_list(topology.node)


@pytest.mark.parametrize("datapath", ["relay", "nftables"])
def test_an_address_added_while_running_serves_nodeports(datapath: str, topology: Topology, tmp_path: Path,
                                                         pods: Pods, agents: Callable[..., AgentProc]) -> None:
    """Within seconds, not at the next periodic full sync (10 × the 30 s sync period)."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"], **NP))
    agent = agents(m, "--nodeport-addresses", "192.0.2.10/32,198.51.100.0/24", *DATAPATH_FLAGS[datapath])
    agent.start()
    serving(agent, datapath)
    assert not _answers(cli, "198.51.100.7")  # not a local address yet
    nsexec(topology.node, "ip", "addr", "add", "198.51.100.7/32", "dev", "usbr0")
    wait_for(lambda: _answers(cli, "198.51.100.7"), timeout=8, what="NodePort on the new address")
    if datapath == "nftables":  # the same sync gave it to the relay, then to the kernel
        wait_for(lambda: "198.51.100.7" in nft_list(topology.node), timeout=2, what="the address in nodeport-ips")
        assert _answers(cli, "198.51.100.7") and kernel_dnat(topology.node, "198.51.100.7")
    nsexec(topology.node, "ip", "addr", "del", "198.51.100.7/32", "dev", "usbr0")
    nsexec(topology.node, "ip", "addr", "add", "198.51.100.8/32", "dev", "usbr0")
    wait_for(lambda: _answers(cli, "198.51.100.8"), timeout=8, what="NodePort on the next address")
    if datapath == "nftables":  # the relay may serve the new address before the kernel's write lands
        wait_for(lambda: "198.51.100.7" not in nft_list(topology.node), timeout=2, what="the old address out of nodeport-ips")


@pytest.mark.parametrize("datapath", ["relay", "nftables"])
def test_primary_is_the_default_route_address(datapath: str, topology: Topology, tmp_path: Path, pods: Pods,
                                              agents: Callable[..., AgentProc]) -> None:
    """`--nodeport-addresses primary`: the node's default route leaves by 192.0.2.0/24, so
    192.0.2.10 (that subnet's first address) serves NodePorts, 192.0.2.11 and 10.244.0.1 not."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    nsexec(topology.node, "ip", "route", "add", "default", "via", "192.0.2.1", "dev", "usbr0")
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"], **NP))
    agent = agents(m, "--nodeport-addresses", "primary", *DATAPATH_FLAGS[datapath])
    agent.start()
    serving(agent, datapath)
    assert tcp_name(cli, "192.0.2.10", 30080) == "be-a"
    for other in ("192.0.2.11", "10.244.0.1"):
        with pytest.raises(ConnectionRefusedError):
            tcp_name(cli, other, 30080)


def _answers(ns: str, addr: str) -> bool:
    try:
        return tcp_name(ns, addr, 30080, timeout=1) == "be-a"
    except OSError:
        return False


def router(topology: Topology, pods: Pods) -> str:
    """A host the node routes 10.96.0.0/15 to, answering as "gw" on 10.96.99.99 and 10.97.0.1
    port 80: what an address of the range reaches when the node routes it on."""
    gw = pods.add("gw", "10.244.200.1", "10.96.99.99", "10.97.0.1", port=80)
    nsexec(gw, "ip", "route", "add", "10.244.9.0/24", "via", "10.244.0.1")  # replies to clients via the node
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/15", "via", "10.244.200.1")
    return gw


def connect_verdict(ns: str, addr: str, timeout: float = 1.5) -> str:
    """"gw" or another endpoint name, "refused", "unreachable", or "timeout" (dropped)."""
    try:
        return tcp_name(ns, addr, 80, timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except (TimeoutError, socket.timeout):
        return "timeout"
    except OSError:
        return "unreachable"


@pytest.mark.parametrize("datapath", ["relay", "nftables"])
def test_unallocated_service_address_is_dropped(datapath: str, topology: Topology, tmp_path: Path, pods: Pods,
                                                agents: Callable[..., AgentProc]) -> None:
    pods.add("be-a", "10.244.1.5")
    router(topology, pods)
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"]))
    agent = agents(m, "--service-cidr", "10.96.0.0/16", *DATAPATH_FLAGS[datapath])
    agent.start()
    serving(agent, datapath)
    wait_for(lambda: connect_verdict(cli, "10.97.0.1") == "gw", what="outside the range: routed on")
    for ns in (cli, topology.node):  # forwarded, and from the node itself
        assert connect_verdict(ns, "10.96.10.10") == "be-a"  # the allocated ClusterIP
        assert connect_verdict(ns, "10.97.0.1") == "gw"
        unallocated = connect_verdict(ns, "10.96.99.99")
        # the relay's blackhole route (relay/service_cidr_routes.py) drops forwarded packets, and
        # fails a node process's connect() at once (EINVAL), where nftables drops both
        assert unallocated == ("timeout" if datapath == "nftables" or ns == cli else "unreachable"), ns
    with pytest.raises(ConnectionRefusedError):
        tcp_name(cli, "10.96.10.10", 81)  # an undefined port of an allocated ClusterIP: refused
    if datapath == "nftables":
        assert "ip daddr 10.96.0.0/16 drop" in nft_list(topology.node)  # nft lists a one-element set bare



def test_read_local_addresses_is_ip_addr_without_the_skipped_interfaces(topology: Topology) -> None:
    """The struct-parsed netlink dump agrees with `ip addr`, and skips the ClusterIP interface's
    addresses (one per Service), and kube-ipvs0's too when asked, by their indexes; one
    interface's addresses alone (interface_addresses) are those ip addr lists on it."""
    node = topology.node
    nsexec(node, "ip", "link", "add", "usproxy0", "type", "bridge")
    for addr in ("10.96.0.1/32", "10.96.0.2/32", "2001:db8:96::1/128"):
        nsexec(node, "ip", "addr", "add", addr, "dev", "usproxy0")
    nsexec(node, "ip", "addr", "add", "2001:db8::10/64", "dev", "usbr0", "nodad")
    nsexec(node, "ip", "link", "add", "kube-ipvs0", "type", "bridge")  # IPVS's device (a dummy where there is one)
    nsexec(node, "ip", "addr", "add", "10.96.0.1/32", "dev", "kube-ipvs0")
    listed = set()
    for line in nsexec(node, "ip", "-o", "addr", "show").stdout.splitlines():
        fields = line.split()
        listed.add((fields[1], ipaddress.ip_address(fields[3].split("/")[0])))
    with inside(node):
        every, skipped = read_local_addresses(), read_local_addresses("usproxy0")
        neither = read_local_addresses("usproxy0", "kube-ipvs0")
        ipvs0, missing = interface_addresses("kube-ipvs0"), interface_addresses("kube-ipvs9")
    assert set(every) == listed and len(every) == len(listed)
    assert set(skipped) == {(n, a) for n, a in listed if n != "usproxy0"}
    assert ("usbr0", ipaddress.ip_address("192.0.2.11")) in skipped and len(skipped) == len(listed) - 3
    assert set(neither) == {(n, a) for n, a in listed if n not in ("usproxy0", "kube-ipvs0")}
    assert len(neither) == len(listed) - 4
    assert ipvs0 == {ipaddress.ip_address("10.96.0.1")} and missing is None
