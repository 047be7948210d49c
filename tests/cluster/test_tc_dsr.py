"""NodePort at tc in DSR mode (`--bpf-lb-mode dsr`, issue 16 item 2), across the three-node cluster.

Every node runs `usproxy run --offload bpf --bpf-lb-mode dsr` with its own pins and cgroup (the
fixtures of test_tc_nodeport.py). The external client reaches NodePorts on n1 (192.0.2.11) whose
only backend, web-b, runs on n2:
- TCP: the backend sees the client's address; the client's connect() succeeds against
  n1:NodePort and data flows both ways, a long-lived connection included; the replies leave n2
  with n1's address and NodePort as their source and reach the lan router from n2's interface, never
  from n1's (an nftables counter in the lan namespace, per sender MAC), and the connection outlives
  a restart of n2's agent (pinned programs and maps); n1's BPF conntrack holds
  only the ORIGINAL (DSR) entry of the flow, n2's the REPLY entry the IP option told it;
- UDP: the same for datagrams (the option rides on every one);
- externalTrafficPolicy Local keeps the client address; a backend on the ingress node itself is
  served as in SNAT mode (DSR only applies to backends on other nodes);
- a LoadBalancer IP and an externalIP (the lan router routes them to n1) take DSR as the NodePort
  does, as Cilium's: the backend on n2 sees the client, the replies leave n2 with the LB IP or
  externalIP and the port as their source, and n2's REPLY entry names that address.
- a closed DSR flow's REPLY entry on n2 rewrites nothing of a later connection that is not DSR
  from the same client address and port (dialled straight to the pod): its SYN removes the entry.
SNAT mode is test_tc_nodeport.py, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.bpf_agents import Agents, ct_entries, node_dirs, served_by_bpf
from tests.cluster.cluster import EXT, LAN, Cluster, node_ip
from tests.cluster.workload import ask, service, slice_of, udp_service, udp_slice
from tests.netns import inside, nsexec
from usproxy.offload.bpf import view
from usproxy.offload.bpf.layout import CT_DSR, CT_ORIGINAL, CT_REPLY

pytestmark = pytest.mark.netns

DSR_NP, LOCAL_NP, UDP_NP, HERE_NP, LB_NP = 30090, 30091, 30092, 30093, 30094
LB_IP, EXTERNAL_IP = "198.51.100.20", "198.51.100.21"
N1 = node_ip(1)
WEB_B = "10.244.2.10"


class DsrAgents(Agents):
    def flags(self, i: int) -> tuple[str, ...]:
        return (*super().flags(i), "--bpf-lb-mode", "dsr")


@pytest.fixture
async def dsr_cluster(tmp_path: Path) -> AsyncIterator[tuple[Cluster, DsrAgents]]:
    from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

    c = Cluster(tmp_path)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    with node_dirs(secrets.token_hex(3)) as dirs:
        try:
            c.build()
            c.add_pod(1, "web-a", "10.244.1.10")
            c.add_pod(2, "web-b", WEB_B)
            c.add_pod(1, "local-a", "10.244.1.11")
            with inside(c.ns("lan")):
                await api.start()
            for name, ip, port, etp, pods in (("dsr", "10.96.30.10", DSR_NP, "Cluster", [(WEB_B, 2)]),
                                              ("dsrl", "10.96.30.11", LOCAL_NP, "Local", [("10.244.1.11", 1)]),
                                              ("here", "10.96.30.13", HERE_NP, "Cluster", [("10.244.1.10", 1)])):
                api.apply("services", service(name, ip, port, etp))
                api.apply("endpointslices", slice_of(name, pods))
            lb = service("dsrlb", "10.96.30.14", LB_NP, "Cluster", type="LoadBalancer", externalIPs=[EXTERNAL_IP])
            lb["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
            api.apply("services", lb)
            api.apply("endpointslices", slice_of("dsrlb", [(WEB_B, 2)]))
            api.apply("services", udp_service("dsru", "10.96.30.12", UDP_NP))
            api.apply("endpointslices", udp_slice("dsru", [(WEB_B, 2)]))
            kc = tmp_path / "kubeconfig"
            kc.write_text(kubeconfig_text(api.url))
            agents = DsrAgents(c, kc, dirs)
            for i in (1, 2, 3):
                await asyncio.to_thread(agents.start, i)
            await served_by_bpf(c, range(1, 4))
            yield c, agents
        finally:
            await asyncio.to_thread(c.close)
            await api.stop()


def mac(ns: str, ifname: str) -> str:
    return str(json.loads(nsexec(ns, "ip", "-j", "link", "show", ifname).stdout)[0]["address"])


def count_replies_by_sender(c: Cluster, proto: str, sport: int) -> None:
    """An nftables counter in the lan (router) namespace per node: packets to the client from
    `sport` that arrive from that node's MAC."""
    lan = c.ns("lan")
    nsexec(lan, "nft", "add table ip usptest")
    nsexec(lan, "nft", "add chain ip usptest pre { type filter hook prerouting priority -300 ; }")
    for i in (1, 2, 3):
        nsexec(lan, "nft", f"add rule ip usptest pre ether saddr {mac(c.node(i), 'eth0')} ip daddr {EXT} "
                           f"{proto} sport {sport} counter comment \"n{i}\"")


def reply_counts(c: Cluster) -> dict[str, int]:
    text = nsexec(c.ns("lan"), "nft", "list chain ip usptest pre").stdout
    return {m[1]: int(m[0]) for m in re.findall(r'counter packets (\d+) bytes \d+ comment "(n\d)"', text)}


def connect(ns: str, addr: str, port: int) -> tuple[socket.socket, str, str]:
    with inside(ns):
        s = socket.socket()
    s.settimeout(3.0)
    s.connect((addr, port))
    name, peer = s.recv(128).decode().split()[:2]
    return s, name, peer


def echo(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def udp_exchange(ns: str, addr: str, port: int, count: int) -> list[tuple[str, str, tuple[str, int]]]:
    """`count` datagrams from one socket: (pod name, peer it saw, source of the answer) each."""
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    out = []
    try:
        for n in range(count):
            s.sendto(f"ping{n}".encode(), (addr, port))
            data, src = s.recvfrom(256)
            name, peer, _ = data.decode().split("|", 2)
            out.append((name, peer, src))
    finally:
        s.close()
    return out


async def test_dsr_reply_leaves_the_backend_node_with_the_nodeport_address(dsr_cluster: tuple[Cluster, DsrAgents]) -> None:
    c, agents = dsr_cluster
    count_replies_by_sender(c, "tcp", DSR_NP)
    s, name, peer = await asyncio.to_thread(connect, c.ns("ext"), N1, DSR_NP)
    try:
        assert (name, peer) == ("web-b", EXT)  # the backend on n2 sees the client's address
        assert s.getpeername() == (N1, DSR_NP)  # the handshake's answer came from n1:NodePort
        sport = s.getsockname()[1]
        bulk = bytes(range(256)) * 1024  # 256 KiB both ways: full-size segments
        assert await asyncio.to_thread(echo, s, bulk) == bulk
        for n in range(25):  # a long-lived connection keeps talking, across n2's agent restart
            assert await asyncio.to_thread(echo, s, f"line {n}\n".encode()) == f"line {n}\n".encode()
            await asyncio.sleep(0.2)
            if n == 8:
                assert c.stop_agent(2) == 0  # pinned programs and maps keep the flow
            if n == 16:
                await asyncio.to_thread(agents.start, 2)
    finally:
        s.close()
    counts = reply_counts(c)
    assert counts["n1"] == 0 and counts["n2"] > 25 and counts["n3"] == 0, counts  # straight from n2
    n1 = [e for e in ct_entries(agents.dirs[1][0]) if str(e.saddr) in (EXT, WEB_B) and sport in (e.sport, e.dport)]
    assert [(e.direction, str(e.nat_saddr), str(e.nat_daddr), e.nat_dport, bool(e.flags & CT_DSR)) for e in n1] == \
        [(CT_ORIGINAL, "0.0.0.0", WEB_B, 8080, True)], n1  # DNAT without SNAT; no reply entry
    assert n1[0].packets > 25, n1
    n2 = [e for e in ct_entries(agents.dirs[2][0]) if e.direction == CT_REPLY and e.dport == sport]
    assert [(str(e.saddr), e.sport, str(e.daddr), str(e.nat_saddr), e.nat_sport, bool(e.flags & CT_DSR)) for e in n2] == \
        [(WEB_B, 8080, EXT, N1, DSR_NP, True)], n2  # recorded from the IP option
    assert n2[0].packets > 25, n2
    rows: list[dict[str, Any]] = await asyncio.to_thread(c.admin, 1, "/services")
    assert {r["servicePortName"]: r["bpfLbMode"] for r in rows}["default/dsr:http"] == "dsr", rows
    assert "mode=dsr" in (view.render_pinned(agents.dirs[1][0]) or "")  # `usproxy explain --live`
    flows = await asyncio.to_thread(c.admin, 1, "/flows")
    assert any(r.get("state") == "DSR" and r["original"]["src"] == f"{EXT}:{sport}" for r in flows), flows


async def test_dsr_udp_local_policy_and_local_backend(dsr_cluster: tuple[Cluster, DsrAgents]) -> None:
    c, agents = dsr_cluster
    ext = c.ns("ext")
    count_replies_by_sender(c, "udp", UDP_NP)
    answers = await asyncio.to_thread(udp_exchange, ext, N1, UDP_NP, 10)
    assert answers == [("web-b", EXT, (N1, UDP_NP))] * 10, answers
    counts = reply_counts(c)
    assert counts["n1"] == 0 and counts["n2"] == 10, counts
    assert await asyncio.to_thread(ask, ext, N1, LOCAL_NP) == ("local-a", EXT)
    # a backend on the ingress node: no other node to return from, SNAT as in snat mode
    assert await asyncio.to_thread(ask, ext, N1, HERE_NP) == ("web-a", "10.244.1.1")
    n2 = [e for e in ct_entries(agents.dirs[2][0]) if e.direction == CT_REPLY and e.proto == socket.IPPROTO_UDP]
    assert [(str(e.nat_saddr), e.nat_sport, bool(e.flags & CT_DSR)) for e in n2] == [(N1, UDP_NP, True)], n2


def peers_seen(c: Cluster, pod: str) -> dict[str, int]:
    """What idsrv in `pod` counted per peer address (TCP connections and UDP datagrams)."""
    path = c.tmp / f"{pod}.json"
    return dict(json.loads(path.read_text())["peers"]) if path.exists() else {}


async def wait_peers(c: Cluster, pod: str, want: dict[str, int]) -> dict[str, int]:
    for _ in range(40):
        seen = peers_seen(c, pod)
        if seen == want:
            break
        await asyncio.sleep(0.1)
    return seen


async def test_udp_datagrams_that_do_not_fit_with_the_option(dsr_cluster: tuple[Cluster, DsrAgents]) -> None:
    """The lab's links have MTU 1500: a 1472-byte payload leaves no room for the 8-byte option."""
    c, agents = dsr_cluster
    with inside(c.ns("ext")):
        first_big, small_first = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    big = b"x" * 1472
    try:
        first_big.sendto(big, (N1, UDP_NP))  # the flow's first datagram does not fit: SNAT
        assert await wait_peers(c, "web-b", {N1: 1}) == {N1: 1}
        port = first_big.getsockname()[1]
        flows = [e for e in ct_entries(agents.dirs[1][0]) if e.direction == CT_ORIGINAL and e.sport == port]
        assert [(str(e.nat_saddr), bool(e.flags & CT_DSR)) for e in flows] == [(N1, False)], flows
        small_first.settimeout(2.0)
        small_first.sendto(b"hello", (N1, UDP_NP))  # a DSR flow: answered from n1:NodePort
        data, src = small_first.recvfrom(256)
        assert data.startswith(f"web-b|{EXT}|".encode()) and src == (N1, UDP_NP), (data, src)
        small_first.sendto(big, (N1, UDP_NP))  # sent without the option: n2 knows the flow already
        assert await wait_peers(c, "web-b", {N1: 1, EXT: 2}) == {N1: 1, EXT: 2}
    finally:
        first_big.close()
        small_first.close()


async def test_dsr_for_a_load_balancer_ip_and_an_external_ip(dsr_cluster: tuple[Cluster, DsrAgents]) -> None:
    c, agents = dsr_cluster
    for ip in (LB_IP, EXTERNAL_IP):  # the cloud's load balancer, or the operator, sends them to n1
        nsexec(c.ns("lan"), "ip", "route", "replace", f"{ip}/32", "via", N1)
    count_replies_by_sender(c, "tcp", 80)
    ports = {}
    for ip in (LB_IP, EXTERNAL_IP):
        s, name, peer = await asyncio.to_thread(connect, c.ns("ext"), ip, 80)
        try:
            assert (name, peer) == ("web-b", EXT), ip  # the backend on n2 sees the client's address
            assert s.getpeername() == (ip, 80)  # the handshake's answer came from the frontend
            assert await asyncio.to_thread(echo, s, b"ping\n") == b"ping\n"
            ports[ip] = s.getsockname()[1]
        finally:
            s.close()
    counts = reply_counts(c)
    assert counts["n1"] == 0 and counts["n2"] >= 4 and counts["n3"] == 0, counts  # straight from n2
    n1 = {str(e.daddr): (str(e.nat_saddr), str(e.nat_daddr), bool(e.flags & CT_DSR))
          for e in ct_entries(agents.dirs[1][0]) if e.direction == CT_ORIGINAL and str(e.saddr) == EXT
          and e.sport in ports.values()}
    assert n1 == {ip: ("0.0.0.0", WEB_B, True) for ip in (LB_IP, EXTERNAL_IP)}, n1  # DNAT, no SNAT
    n2 = {e.dport: (str(e.nat_saddr), e.nat_sport, bool(e.flags & CT_DSR))
          for e in ct_entries(agents.dirs[2][0]) if e.direction == CT_REPLY and e.dport in ports.values()}
    assert n2 == {ports[ip]: (ip, 80, True) for ip in (LB_IP, EXTERNAL_IP)}, n2  # from the IP option


def dial_from(ns: str, port: int, addr: str, dport: int) -> tuple[socket.socket, str, str]:
    """connect() from EXT:`port` (0: any) with SO_REUSEADDR, so a later socket may take the port
    while this one's connection is in TIME_WAIT; the greeting's (pod name, peer) with it."""
    with inside(ns):
        s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.settimeout(3.0)
    try:
        s.bind((EXT, port))
        s.connect((addr, dport))
        name, peer = s.recv(128).decode().split()[:2]
    except BaseException:
        s.close()
        raise
    return s, name, peer


async def test_a_direct_connection_from_a_closed_dsr_flows_client_port(dsr_cluster: tuple[Cluster, DsrAgents]) -> None:
    """Issue 16: n2's REPLY entry of a DSR flow outlives the close (10 s) and is keyed by the
    tuple, which a connection straight to the pod from the same client port reuses; that
    connection's SYN (no DSR option) must remove it, or the pod's SYN-ACK leaves as n1:NodePort
    and the connection stalls."""
    c, agents = dsr_cluster
    ext = c.ns("ext")
    # the client closes first; no TIME_WAIT in the pod either way, as bench/external.py
    nsexec(c.ns("web-b"), "sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0")
    s, name, peer = await asyncio.to_thread(dial_from, ext, 0, N1, DSR_NP)
    port = s.getsockname()[1]
    try:
        assert (name, peer) == ("web-b", EXT) and s.getpeername() == (N1, DSR_NP)
        assert await asyncio.to_thread(echo, s, b"ping\n") == b"ping\n"
    finally:
        s.close()

    def n2_dsr_replies() -> list[tuple[str, int, str]]:
        return [(str(e.saddr), e.sport, str(e.nat_saddr)) for e in ct_entries(agents.dirs[2][0])
                if e.direction == CT_REPLY and str(e.daddr) == EXT and e.dport == port and e.flags & CT_DSR]

    assert n2_dsr_replies() == [(WEB_B, 8080, N1)]  # the closed flow's entry is still there
    s, name, peer = await asyncio.to_thread(dial_from, ext, port, WEB_B, 8080)  # routed, no Service
    try:
        assert s.getsockname() == (EXT, port) and (name, peer) == ("web-b", EXT)
        assert s.getpeername() == (WEB_B, 8080)  # the pod's real address answered
        assert await asyncio.to_thread(echo, s, b"direct\n") == b"direct\n"
    finally:
        s.close()
    assert n2_dsr_replies() == []  # the direct SYN removed it
