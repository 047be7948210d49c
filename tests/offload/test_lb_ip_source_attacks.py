"""Attacks on the hairpin table (issue 27 item 3; usproxy/relay/return_route.py): with
`--hairpin-mark` on, `accept_local` lets packets with a local source in from the network, and
table `ip usproxy-return` must drop every one a node without it drops (the martian check), except
the one real hairpin: a LoadBalancer IP as the source, to that same LB IP.

Netns "lb" (test_lb_ip_source.load_balancer) stands for the outside: it adds the address it
spoofs to its own `lo` and routes what leaves from it to the node. Each test names the attack;
every one of them got through the table before it checked source and destination together, in
every conntrack state, to broadcast, and told bridged frames from routed ones by their
destination MAC (found by an attack helper, 2026-12-05; each test failed on that table).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.netns import Topology, inside, nsexec
from tests.offload.harness import Pods
from tests.offload.test_lb_ip_source import ENDPOINT, LB_IP, LB_SIDE, NODE_SIDE, connect, echoes, greeting, start
from tests.relay.harness import USPROXY, AgentProc, slice_, svc

pytestmark = pytest.mark.netns

CLUSTER_IP = "10.96.10.10"
Hairpins = tuple[Pods, AgentProc, str]
WAIT = 1.0  # what a spoofed packet gets to arrive; each test first shows a real one arrives in it


@pytest.fixture
def hairpins(topology: Topology, tmp_path: Path) -> Iterator[Hairpins]:
    """The nftables datapath with hairpins on (test_lb_ip_source.start): (pods, agent, lb netns)."""
    pods, agent, lb = start(topology, tmp_path, "nftables", "uvloop")
    try:
        yield pods, agent, lb
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()


def spoof(lb: str, source: str, pref: int, add: bool = True) -> None:
    """Netns `lb` sends from `source` (added to its `lo` unless there) to the node, whatever the
    destination."""
    if add:
        nsexec(lb, "ip", "addr", "add", f"{source}/32", "dev", "lo")
    nsexec(lb, "ip", "rule", "add", "pref", str(pref), "iif", "lo", "from", source, "lookup", "200")


@contextmanager
def udp_socket(ns: str, addr: tuple[str, int]) -> Iterator[socket.socket]:
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    s.settimeout(WAIT)
    s.bind(addr)
    try:
        yield s
    finally:
        s.close()


def arrives(receiver: socket.socket) -> bool:
    try:
        return bool(receiver.recv(64))
    except TimeoutError:
        return False


def send(ns: str, source: tuple[str, int], to: tuple[str, int]) -> None:
    with udp_socket(ns, source) as s:
        s.sendto(b"spoofed", to)


def test_a_service_address_as_source_reaches_no_node_process(topology: Topology, hairpins: Hairpins) -> None:
    """A ClusterIP as the source to a node socket on 0.0.0.0, an LB IP to the node's address or
    to a ClusterIP: dropped (they were martians without the table); the LB IP to itself is the
    hairpin and is served."""
    _, _, lb = hairpins
    node = topology.node
    spoof(lb, CLUSTER_IP, 11)
    spoof(lb, LB_IP, 12, add=False)
    with udp_socket(node, ("0.0.0.0", 5300)) as node_socket:
        send(lb, (LB_SIDE, 0), (NODE_SIDE, 5300))
        assert arrives(node_socket)  # the socket and the path work
        for source, to in ((CLUSTER_IP, NODE_SIDE), (LB_IP, NODE_SIDE), (CLUSTER_IP, CLUSTER_IP), (LB_IP, CLUSTER_IP),
                           (LB_IP, LB_IP)):  # the pair itself, to a port that is no ServicePort's
            send(lb, (source, 0), (to, 5300))
            assert not arrives(node_socket), (source, to)
    with inside(node):
        listener = socket.create_server(("0.0.0.0", 5301))
    try:  # the node answers an LB IP source by its route out to the load balancer: no handshake
        for to in (NODE_SIDE, LB_IP):
            with pytest.raises(TimeoutError):
                with inside(lb):
                    socket.create_connection((to, 5301), timeout=WAIT, source_address=(LB_IP, 0)).close()
    finally:
        listener.close()
    with connect(lb, LB_IP) as s:
        assert greeting(s)[0] == "web"


def test_a_node_address_as_source_of_an_established_flow_is_dropped(topology: Topology, hairpins: Hairpins) -> None:
    """The node's own flow (node address to node address, and node to pod) is in conntrack; a
    packet from the network that matches it, as its answer or as more of it, is dropped in
    every conntrack state, not only new ones."""
    pods, _, lb = hairpins
    node, spoofed = topology.node, topology.node_addresses[0]
    spoof(lb, spoofed, 11)
    with udp_socket(node, (NODE_SIDE, 5310)) as node_socket, udp_socket(node, (spoofed, 5311)) as peer:
        node_socket.connect((spoofed, 5311))
        node_socket.send(b"hello")  # conntrack: NODE_SIDE:5310 -> spoofed:5311
        assert arrives(peer)
        send(lb, (spoofed, 5311), (NODE_SIDE, 5310))  # its answer, from the network
        assert not arrives(node_socket)
    pod = topology.ns("web")
    with udp_socket(pod, (ENDPOINT, 5312)) as pod_socket, udp_socket(node, (spoofed, 5313)) as node_socket:
        node_socket.sendto(b"hello", (ENDPOINT, 5312))
        assert arrives(pod_socket)  # conntrack: spoofed:5313 -> ENDPOINT:5312, through usbr0
        send(lb, (spoofed, 5313), (ENDPOINT, 5312))  # more of that flow, from the network
        assert not arrives(pod_socket)


def test_a_node_or_broadcast_address_as_source_to_the_node_is_dropped(topology: Topology, hairpins: Hairpins) -> None:
    """A node address as the source of a datagram to the link's broadcast address, and a
    broadcast address as the source to the node: dropped (accept_local with rp_filter 0 skips
    the kernel's own check of the latter), while one from the load balancer's own address
    reaches the node's 0.0.0.0 socket."""
    _, _, lb = hairpins
    node, spoofed = topology.node, topology.node_addresses[0]
    spoof(lb, spoofed, 11)
    broadcast = "10.255.255.3"  # of the /30 between the node and lb
    with udp_socket(node, ("0.0.0.0", 5320)) as node_socket:
        nsexec(lb, "ip", "rule", "add", "pref", "12", "iif", "lo", "from", LB_SIDE, "to", broadcast, "lookup", "200")
        send(lb, (LB_SIDE, 0), (broadcast, 5320))
        assert arrives(node_socket)
        send(lb, (spoofed, 0), (broadcast, 5320))
        assert not arrives(node_socket)
        spoof(lb, "192.0.2.255", 13)  # the broadcast address of the node's usbr0 as the source
        send(lb, ("192.0.2.255", 0), (NODE_SIDE, 5320))
        assert not arrives(node_socket)


def test_a_node_address_as_source_is_not_routed_back_out_its_link(topology: Topology, hairpins: Hairpins) -> None:
    """A packet the node routes with its own address as the source is dropped, also when it
    leaves by the link it came in by; a frame the node only bridges (pod to pod on usbr0, seen
    by its hooks through br_netfilter) passes with such a source, as it did without the table."""
    pods, _, lb = hairpins
    spoofed = topology.node_addresses[0]
    spoof(lb, spoofed, 11)
    beyond = "198.51.100.7"  # behind lb, which the node routes to by the same link
    nsexec(lb, "ip", "addr", "add", f"{beyond}/32", "dev", "lo")
    with udp_socket(lb, (beyond, 5330)) as outside:
        send(lb, (LB_SIDE, 0), (beyond, 5330))  # lb to itself: the socket works
        assert arrives(outside)
        send(lb, (spoofed, 0), (beyond, 5330))
        assert not arrives(outside)
    other = pods.add("other", "10.244.1.6")
    pod = topology.ns("web")
    nsexec(pod, "ip", "addr", "add", f"{spoofed}/32", "dev", "eth0")
    with udp_socket(other, ("10.244.1.6", 5331)) as bridged:
        send(pod, (spoofed, 0), ("10.244.1.6", 5331))
        assert arrives(bridged)


@pytest.mark.parametrize("datapath", ["relay", "nftables", "iptables"])
def test_a_hairpin_to_a_local_policy_lb_ip_is_an_outside_client(topology: Topology, tmp_path: Path,
                                                                datapath: str) -> None:
    """The one source the table lets in, an LB IP to itself, is an outside client, as in
    kube-proxy (whose LB IPs are no local addresses): to an externalTrafficPolicy Local Service
    with no endpoint on this node it is dropped, not given the node's short-circuit to every
    endpoint. The node's own connection still gets that short-circuit. (Spoofed,
    blind UDP works the same way: what decides is the source, before any answer.)"""
    pods, agent, lb = start(topology, tmp_path, datapath, "uvloop", local_policy=True)
    try:
        with pytest.raises(TimeoutError):
            connect(lb, LB_IP).close()
        with connect(topology.node) as s:
            assert greeting(s)[0] == "web" and echoes(s)
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()


def test_no_local_source_from_the_network_joins_a_flow_of_the_nodes_own(topology: Topology, hairpins: Hairpins) -> None:
    """A node process talking to its own LB IP has the hairpin's addresses (the LB IP is local, so
    it is the socket's source too). A forged answer to it and a forged datagram in its flow, from
    the network, are dropped; and a spoofed pair that took the node's next flow's addresses
    first does not send the node's answers out to the load balancer. In nftables and in the
    relay alone (where the forged datagram in the flow was relayed and answered)."""
    _, agent, lb = hairpins
    node = topology.node
    spoof(lb, LB_IP, 12, add=False)
    for n, datapath in enumerate(("nftables", "relay")):
        if datapath == "relay":
            agent = relay_only(topology, agent)
        with udp_socket(node, (LB_IP, 0)) as client:
            client.connect((LB_IP, 80))
            client.send(b"hello")
            assert arrives(client), datapath  # the node's own query, answered
            port = client.getsockname()[1]
            send(lb, (LB_IP, 80), (LB_IP, port))  # a forged answer
            assert not arrives(client), datapath
            send(lb, (LB_IP, port), (LB_IP, 80))  # a forged query in the node's flow: no second answer
            assert not arrives(client), datapath
        send(lb, (LB_IP, 40000 + n), (LB_IP, 80))  # a real hairpin's shape, the node's next flow's addresses
        with udp_socket(node, (LB_IP, 40000 + n)) as client:
            client.connect((LB_IP, 80))
            client.send(b"hello")
            assert arrives(client), datapath
    agent.stop()


def relay_only(topology: Topology, agent: AgentProc) -> AgentProc:
    """`agent` stopped, and the same Services served by the relay alone (--offload none)."""
    agent.stop()
    relay = AgentProc(topology, agent.manifests, "uvloop", "--offload", "none", "--hairpin-mark", "0x1000")
    relay.start()
    return relay


def test_the_table_comes_back_after_a_firewall_reload(topology: Topology, hairpins: Hairpins) -> None:
    """A firewall reload flushes every table: the agent writes usproxy-return again (within its
    watch period), so a ClusterIP source is dropped again; `--cleanup` with the table gone still
    sets accept_local back to 0 (usproxy's policy rules show it was set)."""
    _, agent, lb = hairpins
    node = topology.node
    spoof(lb, CLUSTER_IP, 11)
    nsexec(node, "nft", "delete", "table", "ip", "usproxy-return")
    deadline = time.monotonic() + 20  # the agent looks every 5 s
    while nsexec(node, "nft", "list", "table", "ip", "usproxy-return", check=False).returncode:
        assert time.monotonic() < deadline, "table usproxy-return not written again"
        time.sleep(0.5)
    with udp_socket(node, ("0.0.0.0", 5340)) as node_socket:
        send(lb, (CLUSTER_IP, 0), (NODE_SIDE, 5340))
        assert not arrives(node_socket)
    with connect(lb, LB_IP) as s:
        assert greeting(s)[0] == "web"
    agent.stop()
    nsexec(node, "nft", "delete", "table", "ip", "usproxy-return")
    assert nsexec(node, USPROXY, "run", "--cleanup", check=False).returncode == 0
    assert nsexec(node, "sysctl", "-n", "net.ipv4.conf.all.accept_local").stdout.strip() == "0"


def test_a_packet_without_conntrack_entry_with_a_node_source_is_not_forwarded(topology: Topology,
                                                                              hairpins: Hairpins) -> None:
    """An ICMP error that quotes a flow conntrack never saw has no entry of its own (invalid): with
    a node address as its source it is not forwarded to a pod (the relay alone, whose node has
    no `ct state invalid` drop of a kernel datapath: --offload none)."""
    pods, agent, lb = hairpins
    relay = relay_only(topology, agent)
    try:
        spoofed = topology.node_addresses[0]
        spoof(lb, spoofed, 11)
        pod = topology.ns("web")
        with inside(pod):
            watcher = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        watcher.settimeout(WAIT)
        try:
            with inside(lb):
                raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
            try:
                raw.bind((LB_SIDE, 0))
                raw.sendto(port_unreachable(ENDPOINT), (ENDPOINT, 0))
                assert icmp_from(watcher, LB_SIDE)  # the path and the watcher work
                raw.close()
                with inside(lb):
                    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
                raw.bind((spoofed, 0))
                raw.sendto(port_unreachable(ENDPOINT), (ENDPOINT, 0))
                assert not icmp_from(watcher, spoofed)
            finally:
                raw.close()
        finally:
            watcher.close()
    finally:
        relay.stop()


def port_unreachable(to: str) -> bytes:
    """An ICMP port unreachable quoting a UDP datagram from `to` that nobody sent."""
    quoted_ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28, 0, 0, 64, 17, 0, socket.inet_aton(to),
                            socket.inet_aton("203.0.113.9"))
    quoted = quoted_ip + struct.pack("!HHHH", 5555, 53, 8, 0)
    header = struct.pack("!BBHI", 3, 3, 0, 0)
    return struct.pack("!BBHI", 3, 3, checksum(header + quoted), 0) + quoted


def checksum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return int(~(total + (total >> 16)) & 0xFFFF)


def icmp_from(watcher: socket.socket, source: str) -> bool:
    """Whether an ICMP packet from `source` reaches the raw socket `watcher` within WAIT."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            packet, (peer, _) = watcher.recvfrom(2048)
        except TimeoutError:
            return False
        if peer == source:
            return True
    return False


def test_a_bridge_mac_that_moves_is_followed(topology: Topology, hairpins: Hairpins) -> None:
    """A bridge's MAC follows its ports (a pod joining may change it) or an admin sets it: the
    agent reads the links' MACs again (every 5 s), so a packet the node routes back out of the
    bridge with a node address as its source stays dropped under the new MAC (with the old set
    it would pass as a bridged frame)."""
    pods, _, _ = hairpins
    node, spoofed = topology.node, topology.node_addresses[0]
    other = pods.add("other", "10.244.1.6")  # a new port: usbr0's MAC may move now
    pod = topology.ns("web")
    nsexec(pod, "ip", "addr", "add", f"{spoofed}/32", "dev", "eth0")
    nsexec(pod, "ip", "route", "add", "10.244.1.6/32", "via", "10.244.0.1")  # routed by the node
    for conf in ("all", "eth0"):  # and kept so: the node's ICMP redirect would make it bridged
        nsexec(pod, "sysctl", "-qw", f"net.ipv4.conf.{conf}.accept_redirects=0")
    with udp_socket(other, ("10.244.1.6", 5350)) as receiver:
        for mac in (bridge_mac(node), "02:00:5e:00:53:27"):
            nsexec(node, "ip", "link", "set", "usbr0", "address", mac)
            nsexec(pod, "ip", "neigh", "flush", "dev", "eth0")
            deadline = time.monotonic() + 20  # the agent looks every 5 s
            while mac not in nsexec(node, "nft", "list", "set", "ip", "usproxy-return", "link-macs").stdout:
                assert time.monotonic() < deadline, f"link-macs did not follow usbr0's MAC {mac}"
                time.sleep(0.5)
            send(pod, (ENDPOINT, 0), ("10.244.1.6", 5350))
            assert arrives(receiver), mac  # the node routes it back out of usbr0
            send(pod, (spoofed, 0), ("10.244.1.6", 5350))
            assert not arrives(receiver), mac


def bridge_mac(node: str) -> str:
    return nsexec(node, "cat", "/sys/class/net/usbr0/address").stdout.strip()


def test_an_lb_ip_that_is_a_node_address_or_a_cluster_ip_opens_nothing(topology: Topology, hairpins: Hairpins) -> None:
    """A Service status naming one of the node's addresses, or another Service's ClusterIP, as
    its LB IP: the pair stays out of the table's `hairpins` (else that address, spoofed as the
    source to itself, would pass to the node); its ordinary LB IP goes in."""
    _, agent, _ = hairpins
    node = topology.node
    doc = yaml.safe_load(agent.manifests.path.read_text())
    impostor = svc("impostor", "10.96.10.20", [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
                   type="LoadBalancer")
    impostor["status"] = {"loadBalancer": {"ingress": [{"ip": topology.node_addresses[1]}, {"ip": CLUSTER_IP},
                                                       {"ip": "198.51.100.9"}]}}
    agent.manifests.write(*doc["items"], impostor,
                          slice_("impostor", [{"ip": ENDPOINT, "ready": True}],
                                 [{"name": "http", "port": 8080, "protocol": "TCP"}]))
    deadline = time.monotonic() + 20
    while "198.51.100.9 . 198.51.100.9" not in (pairs := hairpin_set(node)):
        assert time.monotonic() < deadline, pairs
        time.sleep(0.3)
    assert f"{LB_IP} . {LB_IP}" in pairs
    assert topology.node_addresses[1] not in pairs and CLUSTER_IP not in pairs, pairs


def hairpin_set(node: str) -> str:
    return nsexec(node, "nft", "list", "set", "ip", "usproxy-return", "hairpins").stdout
