"""IpvsDatapath against the real kernel, in a throwaway node namespace (no agent, no relay): this
project's machines have no IPVS, so these run in the VM lab's ipvs guest
(`bash scripts/vm.sh ipvs --run 'python -m pytest -q tests/offload/ipvs'`) and skip elsewhere.

Forwarded TCP and UDP to every endpoint, a virtual server without real servers refusing (C01),
the same over IPv6 and for a dual-stack Service's two ClusterIPs,
a NodePort masqueraded, the node's own connections with ClientIP persistence; a TCP connection to
a removed endpoint running on while new ones avoid it (graceful termination); a removed
ServicePort's connection running on while new connections reach the socket bound to the VIP (a
retired virtual server); a restart adopting everything under a live connection (C20); cleanup
leaving another program's virtual server and Docker's rule; and `usproxy explain --mode ipvs`
equal to the live `ipvsadm -Ln`, `ipset save`, kube-ipvs0 and `iptables-save`.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import categorize
from usproxy.model.local_detector import LocalDetector
from usproxy.model.node import NodeFacts
from usproxy.model.service_set import load_manifests, service_set
from usproxy.model.types import ServicePortName
from usproxy.offload.ipvs import ipsets
from usproxy.offload.ipvs.datapath import IpvsDatapath
from usproxy.offload.ipvs.kernel import Dest, IpvsKernel, Service, _key_msg

from tests.netns import Topology, inside, nsexec, sh
from tests.offload.harness import Pods, tcp_name, tcp_peer_name, udp_socket, wait_listening
from tests.offload.helpers import ep, spn, state
from tests.offload.ipv6_topology import NODE6, Responders, enable_ipv6, host6, tcp_id, udp6
from tests.offload.ipvs.guest import NEEDS_IPVS
from tests.offload.live_flows import UdpSession
from tests.relay.harness import USPROXY


pytestmark = [pytest.mark.netns, NEEDS_IPVS]

VIP, DNS_VIP = "10.96.10.10", "10.96.10.20"
WEB, DNS = spn("web", "http"), spn("dns", "dns", "UDP")
NODE_IP = "192.0.2.10"
FIXTURES = Path(__file__).parents[2] / "explain" / "fixtures"
CIDR = "10.244.0.0/16"


def datapath(topology: Topology, name: str = "node") -> IpvsDatapath:
    return IpvsDatapath(netns=topology.node, node=NodeFacts(name, (ipaddress.ip_network(f"{NODE_IP}/32"),)),
                        node_ips=lambda: (ipaddress.ip_address(NODE_IP),))


@pytest.fixture
def dp(topology: Topology) -> Iterator[IpvsDatapath]:
    d = datapath(topology)
    assert d.probe().available, d.probe()
    try:
        yield d
    finally:
        d.close()


def web(*ips: str, **kw: object) -> ServicePortState:
    return state(WEB, VIP, 80, [ep(i) for i in ips], **kw)


def dns(*ips: str) -> ServicePortState:
    return state(DNS, DNS_VIP, 53, [ep(i) for i in ips])


def ipvsadm(topology: Topology) -> str:
    return nsexec(topology.node, "ipvsadm", "-Ln").stdout


async def test_traffic_refusal_nodeport_and_the_nodes_own(topology: Topology, dp: IpvsDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.2.5", 8080)
    np: dict[str, object] = dict(node_port=30080, service_type="NodePort")
    dns = state(DNS, "10.96.10.11", 53, [ep("10.244.1.5"), ep("10.244.2.5")])
    assert await dp.read_back() == {}
    await dp.apply({WEB: web(**np), DNS: dns})
    with pytest.raises(ConnectionRefusedError):
        tcp_name(cli, VIP, 80)  # no real server: ICMP port unreachable (C01)
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5", **np)})
    assert set(Counter(tcp_name(cli, VIP, 80) for _ in range(20))) == {"be-a", "be-b"}
    seen = set()
    for _ in range(12):
        s = udp_socket(cli)
        s.settimeout(2)
        s.sendto(b"q", ("10.96.10.11", 53))
        data, src = s.recvfrom(512)
        s.close()
        assert src == ("10.96.10.11", 53)  # IPVS reverses the NAT
        seen.add(data.split(b"|")[0])
    assert seen == {b"be-a", b"be-b"}
    assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"  # pod to ClusterIP: not masqueraded
    assert tcp_peer_name(cli, NODE_IP, 30080)[1] == "10.244.0.1"  # NodePort, Cluster policy: masqueraded
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5", session_affinity="ClientIP", affinity_timeout=60)})
    assert "persistent 60" in ipvsadm(topology)
    names = {tcp_name(topology.node, VIP, 80) for _ in range(8)}  # the node's own, one endpoint (persistence)
    assert len(names) == 1


async def test_ipv6_and_dual_stack_through_ipvs(topology: Topology, dp: IpvsDatapath, servers: Responders) -> None:
    """IPv6 ClusterIPs as IPVS virtual servers: refused without real servers (the address is on
    kube-ipvs0 and no socket has the port), then TCP and UDP to both IPv6 endpoints, the client's
    address kept (pod to ClusterIP is not masqueraded), UDP answered from the ClusterIP; a
    dual-stack Service's two ClusterIPs each reach only their own family's endpoints."""
    enable_ipv6(topology)
    addrs = {"v6-a": ("10.244.61.5", "fd00:244::61:5"), "v6-b": ("10.244.62.5", "fd00:244::62:5"),
             "v6-c": ("10.244.63.5", "fd00:244::63:5")}
    for name, (v4, v6) in addrs.items():
        servers.start(host6(topology, name, v4, v6), name)
    cli6 = "fd00:244::69:10"
    cli = host6(topology, "cli6", "10.244.69.10", cli6)
    vip6, dns_vip6, ds4, ds6 = "fd00:96::6a", "fd00:96::6b", "10.96.60.60", "fd00:96::6d"
    web6, dns6, dual = spn("web6", "http"), spn("dns6", "dns", "UDP"), spn("dual", "http")
    six = [ep(addrs["v6-a"][1]), ep(addrs["v6-b"][1])]
    await dp.apply({web6: state(web6, vip6, 80, [])})
    with pytest.raises(ConnectionRefusedError):
        tcp_id(cli, vip6, 80)
    both = [ep(addrs["v6-a"][0]), ep(addrs["v6-b"][0]), ep(addrs["v6-b"][1]), ep(addrs["v6-c"][1])]
    await dp.apply({web6: state(web6, vip6, 80, six), dns6: state(dns6, dns_vip6, 53, six),
                    dual: state(dual, ds4, 80, both, cluster_ips=(ipaddress.ip_address(ds4), ipaddress.ip_address(ds6)))})
    assert f"[{vip6}]:80" in ipvsadm(topology)
    seen = [tcp_id(cli, vip6, 80) for _ in range(30)]
    assert {(n, local) for n, local, _ in seen} == {("v6-a", addrs["v6-a"][1]), ("v6-b", addrs["v6-b"][1])}
    assert {peer for _, _, peer in seen} == {cli6}
    names = set()
    for _ in range(16):
        s = udp6(cli)
        try:
            s.settimeout(2)
            s.sendto(b"q", (dns_vip6, 53))
            data, src = s.recvfrom(512)
        finally:
            s.close()
        assert src[:2] == (dns_vip6, 53)  # IPVS reverses the NAT
        names.add(data.split(b"|")[0])
    assert names == {b"v6-a", b"v6-b"}
    over4 = {(n, local) for n, local, _ in (tcp_id(cli, ds4, 80) for _ in range(30))}
    over6 = {(n, local) for n, local, _ in (tcp_id(cli, ds6, 80) for _ in range(30))}
    assert over4 == {("v6-a", addrs["v6-a"][0]), ("v6-b", addrs["v6-b"][0])}
    assert over6 == {("v6-b", addrs["v6-b"][1]), ("v6-c", addrs["v6-c"][1])}
    assert NODE6 not in ipvsadm(topology)  # a ClusterIP Service: no virtual server on the node's address


async def test_a_removed_endpoint_keeps_its_connection(topology: Topology, dp: IpvsDatapath, pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.2.5", 8080)
    await dp.apply({WEB: web("10.244.1.5", "10.244.2.5")})
    held: list[tuple[str, socket.socket]] = []
    while len({n for n, _ in held}) < 2:  # one connection to each endpoint, kept open
        with inside(cli):
            s = socket.socket()
        s.settimeout(3)
        s.connect((VIP, 80))
        held.append((s.recv(128).decode().split()[0], s))
    await dp.apply({WEB: web("10.244.1.5")})
    weights = {w[1]: w[3] for w in (line.split() for line in ipvsadm(topology).splitlines()) if w[:1] == ["->"]}
    assert weights["10.244.2.5:8080"] == "0"  # weight 0 while it has connections
    assert {tcp_name(cli, VIP, 80) for _ in range(10)} == {"be-a"}
    for name, s in held:
        s.sendall(b"x")
        assert s.recv(64), name  # the echo server answers: still connected through IPVS
        s.close()


async def test_a_removed_service_port_keeps_its_connection_and_new_ones_reach_the_vip(
        topology: Topology, dp: IpvsDatapath, pods: Pods) -> None:
    """What a demotion to the relay does: the retired virtual server keeps the old connection
    and sends new ones to the socket bound to VIP:port (here a listener standing in for it)."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    await dp.apply({WEB: web("10.244.1.5")})
    with inside(cli):
        old = socket.socket()
    old.settimeout(3)
    old.connect((VIP, 80))
    assert old.recv(128).startswith(b"be-a")
    nsexec(topology.node, "ip", "addr", "add", f"{VIP}/32", "dev", "lo")  # as the relay's usproxy0 holds it
    with inside(topology.node):
        relay = socket.socket()
    relay.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    relay.bind((VIP, 80))
    relay.listen(8)
    await dp.apply({WEB: None})
    assert f"-> {VIP}:80" in ipvsadm(topology)
    with inside(cli):
        new = socket.socket()
    new.settimeout(3)
    new.connect((VIP, 80))
    conn, peer = relay.accept()
    assert peer[0] == "10.244.9.10"  # the relay sees the client
    conn.close()
    new.close()
    old.sendall(b"x")
    assert old.recv(64)  # the old connection still reaches be-a
    old.close()
    relay.close()


class UdpStandIn(threading.Thread):
    """A UDP socket on the node bound to addr, answering as the relay would ("relay|peer|payload")."""

    def __init__(self, ns: str, addr: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        with inside(ns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                data, peer = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            self.sock.sendto(b"relay|" + peer[0].encode() + b"|" + data, peer)
        self.sock.close()


def answered(session: UdpSession, since: float, by: str) -> int:
    return len([t for t, name in session.answers if t > since and name == by])


async def test_a_relayed_udp_session_moves_to_ipvs_and_keeps_being_answered(topology: Topology, dp: IpvsDatapath,
                                                                            pods: Pods) -> None:
    """A UDP session the relay answers (a socket bound to VIP:53 stands in for it) is answered by
    the endpoint once its virtual server is added: IPVS schedules its next datagram. The session's
    conntrack entry, made without NAT, would clash with IPVS's answers (the kernel then gives them
    another source port, which the client's connected socket drops), so the datapath deletes the
    entries to a frontend new to it, as kube-proxy for a newly active UDP Service. Datagrams keep
    flowing through the change; a full sync (a read back) later changes nothing for the session."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    nsexec(topology.node, "ip", "addr", "add", f"{DNS_VIP}/32", "dev", "lo")  # as the relay's usproxy0 holds it
    relay = UdpStandIn(topology.node, (DNS_VIP, 53))
    relay.start()
    session = UdpSession(cli, 0.02, (DNS_VIP, 53))
    session.start()
    try:
        deadline = time.monotonic() + 10
        while answered(session, 0, "relay") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answered(session, 0, "relay") >= 5, session.answers[-5:]
        await dp.apply({DNS: dns("10.244.1.5")})
        t_off = time.monotonic()
        time.sleep(1.5)
        assert answered(session, t_off, "be-a") >= 10, (session.answers[-5:], session.losses)
        await dp.read_back()
        await dp.apply({DNS: dns("10.244.1.5")})  # a full sync
        t_full = time.monotonic()
        time.sleep(1.5)
        assert answered(session, t_full, "be-a") >= 10, (session.answers[-5:], session.losses)
    finally:
        session.stop.set()
        relay.stop.set()
        session.join(3)
        relay.join(3)


class UdpStream:
    """One connected UDP socket sending b"q<n>" every `period` s without waiting for answers (a
    sender and a receiver thread), so a window in which answers are dropped shows as the number
    of queries never answered. `answers`: n -> name of the answering endpoint."""

    def __init__(self, ns: str, addr: tuple[str, int], period: float) -> None:
        with inside(ns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(addr)
        self.sock.settimeout(0.2)
        self.period = period
        self.sent = 0
        self.answers: dict[int, str] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._send, daemon=True), threading.Thread(target=self._receive, daemon=True)]
        for t in self.threads:
            t.start()

    def _send(self) -> None:
        while not self.stop.is_set():
            self.sock.send(f"q{self.sent}".encode())
            self.sent += 1
            self.stop.wait(self.period)

    def _receive(self) -> None:
        while not self.stop.is_set():
            try:
                name, _, payload = self.sock.recv(2048).split(b"|", 2)
            except (TimeoutError, ConnectionRefusedError):
                continue
            self.answers[int(payload[1:])] = name.decode()

    def close(self) -> tuple[int, dict[int, str]]:
        """Stop sending, give the last answers 0.5 s, stop; (queries sent, answers)."""
        sent = self.sent
        time.sleep(0.5)
        self.stop.set()
        for t in self.threads:
            t.join(3)
        self.sock.close()
        return sent, dict(self.answers)


async def test_with_conntrack_already_on_a_relayed_udp_session_loses_at_most_a_few_datagrams(
        topology: Topology, dp: IpvsDatapath, pods: Pods) -> None:
    """As above, on a node where conntrack tracks everything from the start (here a `ct state new`
    rule; a firewall or Docker does the same): the relayed session's datagrams made an entry
    without NAT. Until the datapath deletes it, each datagram IPVS forwards finds that entry, and
    the endpoint's answer, translated back by IPVS, clashes with it and is dropped. The entry is
    deleted as soon as the virtual server is in, before the iptables rules are written (deleted
    after them, the window was the whole rest of the sync: ~0.3 s, 30 queries at this rate, under
    TCG). The entries are listed before the virtual server goes in, so the delete right after
    opens and dumps nothing: what remains, from the write to the delete, measured 8.6-14 ms under
    TCG on a quiet host (33-125 ms with the listing inside it; README, "The IPVS datapath"). At
    most 5 of a session's queries sent every 10 ms may go unanswered (never more than 1 in 44
    guest runs, with the listing before the write or inside the window), and from the offload on
    one endpoint answers them all."""
    nsexec(topology.node, "nft", "add table ip ct-on; add chain ip ct-on c { type filter hook prerouting priority 0; }; "
           "add rule ip ct-on c ct state new counter")
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.2.5", 8080)
    nsexec(topology.node, "ip", "addr", "add", f"{DNS_VIP}/32", "dev", "lo")  # as the relay's usproxy0 holds it
    relay = UdpStandIn(topology.node, (DNS_VIP, 53))
    relay.start()
    stream = UdpStream(cli, (DNS_VIP, 53), 0.01)
    try:
        time.sleep(0.5)
        assert "relay" in stream.answers.values(), stream.answers
        await dp.apply({DNS: dns("10.244.1.5", "10.244.2.5")})
        time.sleep(1.5)
    finally:
        sent, answers = stream.close()
        relay.stop.set()
        relay.join(3)
    lost = [n for n in range(sent) if n not in answers]
    assert len(lost) <= 5, (lost, sent)
    first = min(n for n, name in answers.items() if name != "relay")
    after = {answers[n] for n in answers if n >= first}
    assert len(after) == 1 and "relay" not in after, after


async def test_a_restart_adopts_everything_under_a_live_connection(topology: Topology, dp: IpvsDatapath,
                                                                   pods: Pods) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    states = {WEB: web("10.244.1.5", node_port=30080, service_type="NodePort")}
    await dp.apply(states)
    with inside(cli):
        s = socket.socket()
    s.settimeout(3)
    s.connect((VIP, 80))
    s.recv(128)
    before = (ipvsadm(topology), nsexec(topology.node, "ipset", "save").stdout)
    dp.close()
    dp2 = datapath(topology)
    try:
        assert await dp2.read_back() == {WEB: (ep("10.244.1.5"),)}
        await dp2.apply(states)
        assert dp2.kernel.worker  # still here
        after = (ipvsadm(topology), nsexec(topology.node, "ipset", "save").stdout)
        assert after == before
        s.sendall(b"x")
        assert s.recv(64)
    finally:
        s.close()
        dp2.close()


def virtual_servers(topology: Topology) -> dict[str, set[str]]:
    """`ipvsadm -Ln`: "PROTO addr:port scheduler" -> {"addr:port weight"} of its real servers."""
    out: dict[str, set[str]] = {}
    head = ""
    for line in ipvsadm(topology).splitlines():
        if line.startswith(("TCP", "UDP")):
            head = " ".join(line.split()[:3])
            out[head] = set()
        elif line.strip().startswith("->") and head:
            words = line.split()
            out[head].add(f"{words[1]} {words[3]}")
    return out


async def test_hundreds_of_virtual_servers_land_in_batched_writes(topology: Topology, dp: IpvsDatapath,
                                                                  pods: Pods) -> None:
    """A cold sync sends its new virtual servers with their real servers many to a netlink write
    (messages.py): 300 ServicePorts with 2 endpoints each (900 messages, several writes) land
    exactly, kube-ipvs0 holds their 300 ClusterIPs, a leftover virtual server of the same key
    (EEXIST in the middle of a write) is taken over without stopping the rest, and traffic
    reaches the endpoints through one of them."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    nsexec(topology.node, "ipvsadm", "-A", "-t", "10.96.21.150:80", "-s", "wlc")  # a kube-proxy leftover
    wanted = {spn(f"s{n}", "http"): state(spn(f"s{n}", "http"), f"10.96.{20 + n // 100}.{n % 100 + 100}", 80,
                                          [ep("10.244.1.5"), ep(f"10.244.3.{n % 200 + 1}")]) for n in range(300)}
    await dp.apply(wanted)
    assert virtual_servers(topology) == {
        f"TCP {st.service_port.cluster_ips[0]}:80 rr": {"10.244.1.5:8080 1", f"10.244.3.{n % 200 + 1}:8080 1"}
        for n, st in enumerate(wanted.values())}
    shown = nsexec(topology.node, "ip", "-o", "-4", "addr", "show", "dev", "kube-ipvs0").stdout.splitlines()
    assert {row.split()[3] for row in shown} == {f"{st.service_port.cluster_ips[0]}/32" for st in wanted.values()}
    await dp.apply({s: state(s, str(st.service_port.cluster_ips[0]), 80, [ep("10.244.1.5")])
                    for s, st in list(wanted.items())[150:151]})  # the taken-over one, one endpoint
    assert virtual_servers(topology)["TCP 10.96.21.150:80 rr"] == {"10.244.1.5:8080 1"}
    wait_listening(cli, "10.244.1.5", 8080)
    assert tcp_name(cli, "10.96.21.150", 80) == "be-a"


def pyroute2_dump(kernel: IpvsKernel) -> list[tuple[Service, list[Dest]]]:
    """The reference reader: pyroute2's IPVS dumps, decoded by its message classes (in the
    kernel's worker thread, inside the node's namespace)."""
    def attr(msg: Any, nla: str, name: str) -> Any:
        return msg.get(nla).get_attr(name)

    def read() -> list[tuple[Service, list[Dest]]]:
        ipvs, out = kernel._sock(), []
        for m in ipvs.service("dump"):
            s = "IPVS_CMD_ATTR_SERVICE"
            if attr(m, s, "IPVS_SVC_ATTR_FWMARK"):
                continue
            svc = Service({6: "TCP", 17: "UDP"}[attr(m, s, "IPVS_SVC_ATTR_PROTOCOL")],
                          ipaddress.ip_address(str(attr(m, s, "IPVS_SVC_ATTR_ADDR"))), attr(m, s, "IPVS_SVC_ATTR_PORT"),
                          attr(m, s, "IPVS_SVC_ATTR_SCHED_NAME"), attr(m, s, "IPVS_SVC_ATTR_FLAGS")["flags"] & ~0x2,
                          attr(m, s, "IPVS_SVC_ATTR_TIMEOUT"))
            d = "IPVS_CMD_ATTR_DEST"
            dests = [Dest(ipaddress.ip_address(str(attr(r, d, "IPVS_DEST_ATTR_ADDR"))), attr(r, d, "IPVS_DEST_ATTR_PORT"),
                          attr(r, d, "IPVS_DEST_ATTR_WEIGHT"), attr(r, d, "IPVS_DEST_ATTR_FWD_METHOD") & 7,
                          attr(r, d, "IPVS_DEST_ATTR_ACTIVE_CONNS"), attr(r, d, "IPVS_DEST_ATTR_INACT_CONNS"))
                     for r in ipvs.dest("dump", service=_key_msg(svc.key))]
            out.append((svc, dests))
        return out
    return kernel.worker.call(read, timeout=60)


async def test_the_struct_dump_reads_what_pyroute2_reads(topology: Topology, dp: IpvsDatapath, pods: Pods) -> None:
    """IpvsKernel.dump (messages.py's dump requests and parsers) against pyroute2's reading of the
    same kernel: IPv4 and IPv6, TCP and UDP, persistence, a weight-0 real server, a live
    connection's count, and another program's firewall-mark and plain virtual servers."""
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    web6 = spn("web6", "http")
    await dp.apply({WEB: web("10.244.1.5", session_affinity="ClientIP", affinity_timeout=60), DNS: dns("10.244.1.5"),
                    web6: state(web6, "fd00:96::7", 80, [ep("fd00:244::5"), ep("fd00:244::6")])})
    node = topology.node
    nsexec(node, "ipvsadm", "-e", "-t", "[fd00:96::7]:80", "-r", "[fd00:244::6]:8080", "-m", "-w", "0")
    nsexec(node, "ipvsadm", "-A", "-f", "7", "-s", "rr")
    nsexec(node, "ipvsadm", "-A", "-u", "198.51.100.7:53", "-s", "sh")
    nsexec(node, "ipvsadm", "-a", "-u", "198.51.100.7:53", "-r", "198.51.100.8:53", "-m", "-w", "3")
    wait_listening(cli, "10.244.1.5", 8080)
    held = subprocess.Popen(["ip", "netns", "exec", cli, "python3", "-c",
                             f"import socket, time; s = socket.create_connection(('{VIP}', 80)); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 15
        while True:
            ours = dp.kernel.worker.call(dp.kernel.dump, timeout=60)
            if any(d.active for _, ds in ours for d in ds) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(ours, key=str) == sorted(pyroute2_dump(dp.kernel), key=str)
    finally:
        held.kill()
        held.wait()
    assert {s.key for s, _ in ours} == {("TCP", ipaddress.ip_address(VIP), 80), ("UDP", ipaddress.ip_address(DNS_VIP), 53),
                                        ("TCP", ipaddress.ip_address("fd00:96::7"), 80),
                                        ("UDP", ipaddress.ip_address("198.51.100.7"), 53)}
    assert any(d.active for _, ds in ours for d in ds), "the live connection's count"
    assert any(d.weight == 0 for _, ds in ours for d in ds) and any(s.timeout == 60 for s, _ in ours)


async def test_cleanup_leaves_what_is_not_usproxys(topology: Topology, dp: IpvsDatapath) -> None:
    await dp.apply({WEB: web("10.244.1.5", node_port=30080, service_type="NodePort")})
    nsexec(topology.node, "ipvsadm", "-A", "-t", "198.51.100.7:443", "-s", "wlc")
    docker = ("-s", "172.17.0.0/16", "!", "-o", "docker0", "-j", "MASQUERADE")
    nsexec(topology.node, "iptables-nft", "-t", "nat", "-A", "POSTROUTING", *docker)
    assert await dp.leftovers()
    await dp.cleanup()
    assert [line for line in ipvsadm(topology).splitlines() if line.startswith(("TCP", "UDP"))] == \
        ["TCP  198.51.100.7:443 wlc"]
    assert "KUBE-" not in nsexec(topology.node, "iptables-nft-save").stdout
    assert nsexec(topology.node, "ipset", "list", "-n").stdout.strip() == ""
    assert nsexec(topology.node, "ip", "link", "show", "kube-ipvs0", check=False).returncode != 0
    assert nsexec(topology.node, "iptables-nft", "-t", "nat", "-C", "POSTROUTING", *docker,
                  check=False).returncode == 0
    assert await dp.leftovers() == []


# -- explain --mode ipvs == the live state ----------------------------------------------------------
def states_of(path: Path, node: str) -> dict[ServicePortName, ServicePortState]:
    """The ServicePortStates the Proxier hands the datapaths for these manifests on `node`."""
    out = {}
    for sp, eps in service_set(load_manifests(path)).ports:
        cat = categorize(sp, eps, node)
        short = cat.cluster_policy if sp.external_traffic_policy == "Local" else ()
        out[sp.name] = ServicePortState(sp, eps, cat.cluster, cat.external, short)
    return out


def sections(text: str) -> dict[tuple[int, str], str]:
    """explain's output cut at its "# " headers: (family, header) -> text."""
    out: dict[tuple[int, str], list[str]] = {}
    family, head = 4, ""
    for line in text.splitlines():
        if line.startswith("# ipvsadm -Ln"):
            family = 6 if "IPv6" in line else 4
        if line.startswith("# ") and not line.startswith("# (NodePort"):
            head = line.split("(")[0].split(":")[0].strip("# ").strip()
            continue
        if line.startswith("===="):
            head = ""
        if head:
            out.setdefault((family, head), []).append(line)
    return {k: "\n".join(v).strip() + "\n" for k, v in out.items()}


def table(text: str, family: int) -> dict[str, list[str]]:
    """`ipvsadm -Ln` of one family as {service line: its real-server lines, sorted}, connection
    counters dropped (ipvsadm lists services in the kernel's hash order unless asked to sort)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        words = line.split()
        if words[:1] and words[0] in ("TCP", "UDP", "SCTP"):
            current = " ".join(words) if ("[" in words[1]) == (family == 6) else None
            if current is not None:
                out[current] = []
        elif line.startswith("  -> ") and words[1] != "RemoteAddress:Port" and current is not None:
            out[current].append(" ".join(words[:4]))
    return {k: sorted(v) for k, v in out.items()}


def sets(text: str) -> dict[str, tuple[str, str, list[str]]]:
    """ipset save of kube-proxy's sets: (type, options without bucketsize/initval, sorted members)."""
    return {name: (s.type, ipsets.normal(s.header), sorted(s.members)) for name, s in ipsets.parse_save(text).items()
            if not name.startswith("USPROXY-")}


def kube_lines(text: str) -> dict[str, list[str]]:
    """iptables-save's KUBE- chains and the rules that name one, by chain, in order."""
    out: dict[str, list[str]] = {}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line
        elif line.startswith(":KUBE-"):
            out.setdefault(f"{table} {line.split()[0]}", [])
        elif line.startswith("-A ") and "KUBE-" in line:
            out.setdefault(f"{table} {line.split()[1]}", []).append(line)
    return out


@pytest.mark.parametrize("fixture", ["clusterip", "nodeport", "affinity_udp", "kube_proxy_overall"])
async def test_explain_equals_the_live_state(topology: Topology, fixture: str) -> None:
    """`usproxy explain --mode ipvs` for explain's own fixtures against what the datapath holds:
    the same virtual servers and real servers, kube-ipvs0 addresses, kube-proxy's 17 sets with
    the same members (usproxy's own USPROXY-IPVS aside: the names IPVS cannot hold), and the
    same iptables rules and jumps: explain's sets and restore input loaded into an empty
    namespace give the same iptables-save there as the datapath's node."""
    path = FIXTURES / f"{fixture}.yaml"
    d = IpvsDatapath(netns=topology.node, node=NodeFacts("node-a", (ipaddress.ip_network(f"{NODE_IP}/32"),),
                                                         detector=_detector()),
                     node_ips=lambda: (ipaddress.ip_address(NODE_IP),))
    try:
        await d.apply(states_of(path, "node-a"))
    finally:
        d.close()
    argv = [USPROXY, "explain", "--services", str(path), "--mode", "ipvs", "--node-name", "node-a",
            "--node-ip", NODE_IP, "--cluster-cidr", CIDR]
    explained = sections(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    live_sets = sets(nsexec(topology.node, "ipset", "save").stdout)
    for family in (4, 6):
        if (family, "ipvsadm -Ln") not in explained:
            continue
        assert table(ipvsadm(topology), family) == table(explained[(family, "ipvsadm -Ln")], family), fixture
        want = {ipaddress.ip_interface(w.split()[1]).ip for w in explained[(family, "ip addr show kube-ipvs0")]
                .splitlines() if w.strip().startswith(("inet ", "inet6 "))}
        got = {ipaddress.ip_interface(w.split()[3]).ip for w in nsexec(topology.node, "ip", "-o", f"-{family}", "addr",
                                                                        "show", "kube-ipvs0").stdout.splitlines()}
        assert got == want
        want_sets = sets(explained[(family, "ipset save")])
        assert {k: v for k, v in live_sets.items() if k in want_sets} == want_sets
    scratch = topology.ns("scratch")
    sh("ip", "netns", "add", scratch)
    topology.namespaces.append(scratch)
    for family in (4, 6):
        if (family, "ipset save") not in explained:
            continue
        nsexec_input(scratch, ["ipset", "restore"], explained[(family, "ipset save")])
        tool = "iptables-nft" if family == 4 else "ip6tables-nft"
        restore = explained[(family, f"{tool.split('-')[0]}-restore input")]
        jumps = explained[(family, "entry jumps")]
        nsexec_input(scratch, [f"{tool}-restore", "--noflush"], restore + jumps)
        assert kube_lines(nsexec(scratch, f"{tool}-save").stdout) == \
            kube_lines(nsexec(topology.node, f"{tool}-save").stdout), (fixture, family)


def _detector() -> LocalDetector:
    return LocalDetector("ClusterCIDR", (ipaddress.ip_network(CIDR),))


def nsexec_input(ns: str, argv: list[str], text: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, *argv], input=text, capture_output=True, text=True)
    assert r.returncode == 0, (argv, r.stderr, text)


