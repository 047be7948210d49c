"""A round of attacks on the tc and XDP programs (issue 29), in the cluster of hostile_lab.py with
XDP on n1's uplink ("xdp": what XDP passes, tc serves). One client connection through n1:PUSH_NP
to push-b (n2) stays open and idle through all of them, and one UDP session to n1:UDP_NP; at the
end the server's push arrives on the connection, which still echoes, the session is answered by
the same pod from n1:UDP_NP, and the programs attached at the start are still the ones attached.

From a host on the node network (the lan namespace, sending Ethernet frames to n1's eth0 with
AF_PACKET, so nothing on the way repairs them):
- truncated and malformed headers, SYNs where there is room for one: an IPv4 header with no TCP
  or UDP header after it, 8 bytes of TCP (tc loads 14), 4 bytes of UDP, a header length of 15
  words in a 20-byte header, one of 4 words, a total length past the frame (the stack would drop
  it: tc and XDP pass it, where before they opened a flow and forwarded it) or inside the header,
  an IP version 6 nibble, an ICMP error quoting 10 bytes,
  one quoting an IP header of 15 words, one quoting an ICMP message: none opens a flow (no
  conntrack entry appears for their addresses), none disturbs the others;
- TTL 1 on a SYN to n1:PUSH_NP: tc forwards without decrementing (it is not the router here), n2
  decrements on its way to the pod and answers "time exceeded" to the SNAT address, and n1 relates
  it to the flow: the sender gets it from n1:PUSH_NP's address, quoting its own SYN to n1:PUSH_NP;
- a SYN whose source is n1's own address and port, and one from 127.0.0.1: the reply has nowhere
  to go (the route lookup finds a local address) and is dropped.
From outside (ext, raw sockets):
- 20,000 ICMP errors (fragmentation needed with MTU 552, port unreachable) quoting the live
  connection's reply as n1 sent it, with random sequence numbers: n1 relates each to the flow and
  forwards it to push-b, whose TCP drops them (the quoted sequence is not one it sent);
- 10,000 later fragments (offset > 0) with random IP ids to n1: no first fragment was seen, so tc
  passes them to the stack, which drops them when its reassembly times out;
- a connection that carries IP options on every segment (IP_OPTIONS: the DSR option itself, to
  n1, where no DSR flow is): served through tc with SNAT (XDP passes a header longer than 20);
- a RST with a random sequence number on the live connection's tuple, then 12 s of silence: the
  client's side closes no entry (sock_lb.c ct_touch), so the push still arrives. Before issue 29
  the RST marked the entries closing and they expired after 10 s idle;
- a client port reused at once for a new connection after the server closed the last one (its
  entries are closing): the SYN opens a new flow (XDP leaves it to tc), which a push after the same
  12 s of silence still reaches, rather than riding the closing entries until they expire.
"""

from __future__ import annotations

import asyncio
import errno
import json
import random
import socket
import struct
import time
from pathlib import Path

import pytest

from tests.cluster import packets
from tests.cluster.cluster import EXT, LAN, node_ip
from tests.cluster.hostile_lab import PUSH_NP, UDP_NP, Line, dns_service, hostile_lab, push_service
from tests.cluster.test_tc_flood import udp_ask, udp_session
from tests.cluster.bpf_agents import ct_entries
from tests.cluster.test_tc_nodeport import tc_programs
from tests.netns import inside, nsexec

pytestmark = pytest.mark.netns

N1 = node_ip(1)
ETH_P_IP = 0x0800


def mac(ns: str, ifname: str) -> bytes:
    text = json.loads(nsexec(ns, "ip", "-j", "link", "show", ifname).stdout)[0]["address"]
    return bytes.fromhex(text.replace(":", ""))


def raw_header(src: str, dst: str, proto: int, total: int, ihl: int = 5, version: int = 4) -> bytes:
    head = struct.pack("!BBHHHBBH4s4s", version << 4 | ihl, 0, total, 0, 0x4000, 64, proto, 0,
                       socket.inet_aton(src), socket.inet_aton(dst))
    return head[:10] + struct.pack("!H", packets.csum(head)) + head[12:]


def malformed(src: str) -> dict[str, bytes]:
    """IPv4 packets (no Ethernet header) that no parser may trust."""
    tcp, udp, icmp = socket.IPPROTO_TCP, socket.IPPROTO_UDP, socket.IPPROTO_ICMP
    ports = struct.pack("!HH", 40000, PUSH_NP)
    syn = packets.tcp(src, N1, 40000, PUSH_NP, packets.TCP_SYN)
    quote_ip = raw_header(N1, src, tcp, 60)
    return {
        "no L4 header": raw_header(src, N1, tcp, 20),
        "8 bytes of TCP": raw_header(src, N1, tcp, 28) + syn[:8],
        "4 bytes of UDP": raw_header(src, N1, udp, 24) + struct.pack("!HH", 40000, UDP_NP),
        "header of 15 words in 20 bytes": raw_header(src, N1, tcp, 40, ihl=15) + syn,
        "header of 4 words": raw_header(src, N1, tcp, 40, ihl=4) + syn,
        "total length past the frame": raw_header(src, N1, tcp, 1400) + syn,
        "total length inside the header": raw_header(src, N1, tcp, 12) + syn,
        "version 6": raw_header(src, N1, tcp, 40, version=6) + syn,
        "ICMP quoting 10 bytes": raw_header(src, N1, icmp, 38) + packets.icmp(3, 4, 552, quote_ip[:10]),
        "ICMP quoting 15 words": raw_header(src, N1, icmp, 56) + packets.icmp(3, 4, 552, raw_header(N1, src, tcp, 60, ihl=15) + ports + b"\0" * 4),
        "ICMP quoting ICMP": raw_header(src, N1, icmp, 56) + packets.icmp(3, 1, 0, raw_header(N1, src, icmp, 28) + b"\x08\0\0\0\0\0\0\0"),
    }


def send_frames(ns: str, ifname: str, dst_mac: bytes, frames: list[bytes], times: int) -> None:
    with inside(ns):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((ifname, 0))
        head = dst_mac + mac(ns, ifname) + struct.pack("!H", ETH_P_IP)
        for _ in range(times):
            for f in frames:
                s.send(head + f)
    finally:
        s.close()


def icmp_storm(ns: str, client_port: int, count: int) -> None:
    """ICMP errors to n1 quoting the reply n1 sends to EXT:client_port, random sequence numbers."""
    with packets.RawSender(ns) as sender:
        for i in range(count):
            quoted = packets.tcp(N1, EXT, PUSH_NP, client_port, packets.TCP_ACK, seq=random.getrandbits(32))
            inner = packets.ipv4(N1, EXT, socket.IPPROTO_TCP, quoted)[:28]
            kind = (3, 4, 552) if i % 2 else (3, 3, 0)
            sender.send(packets.ipv4("203.0.113.1", N1, socket.IPPROTO_ICMP, packets.icmp(*kind, inner)))


def fragment_storm(ns: str, count: int) -> None:
    with packets.RawSender(ns) as sender:
        for _ in range(count):
            sender.send(packets.ipv4(EXT, N1, socket.IPPROTO_UDP, b"\0" * 64, ident=random.getrandbits(16),
                                     frag=random.randrange(1, 0x1FFF) | packets.MF))


def options_connection(ns: str) -> str:
    """A connection to n1:PUSH_NP whose every segment carries an IP option (the DSR option)."""
    with inside(ns):
        s = socket.socket()
    try:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, packets.dsr_option(N1, PUSH_NP))
        s.settimeout(3.0)
        s.connect((N1, PUSH_NP))
        greeting = s.recv(100).decode()
        s.sendall(b"with options\n")
        echoed = s.recv(100).decode()
        return greeting.split()[0] + " " + echoed.strip()
    finally:
        s.close()


def closed_and_reopened(ns: str, port: int) -> Line:
    """A connection from EXT:`port` that the server closes first, then a new one from the same
    port to the same frontend (no TIME_WAIT on either side: the client closed second, the pod keeps
    none)."""
    first = Line(ns, N1, PUSH_NP, bind=(EXT, port))
    try:
        first.send("bye")
        assert first.sock.recv(100) == b""  # the server's FIN
    finally:
        first.close()
    for _ in range(20):  # until the pod's last ACK frees the tuple here
        try:
            return Line(ns, N1, PUSH_NP, bind=(EXT, port))
        except OSError as err:
            if err.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                raise
            time.sleep(0.1)
    return Line(ns, N1, PUSH_NP, bind=(EXT, port))


def lan_entries(c_pins: Path, addr: str) -> list[object]:
    return [e for e in ct_entries(c_pins) if addr in (str(e.saddr), str(e.daddr))]


async def test_attacks_on_the_tc_and_xdp_programs(tmp_path: Path) -> None:
    pods = ["push-b"]
    async with hostile_lab(tmp_path, "xdp", pods, push_service(pods) + dns_service(pods)) as (c, agents):
        ext, lan, pins = c.ns("ext"), c.ns("lan"), agents.dirs[1][0]
        programs = tc_programs(c.node(1), "eth0")
        flag = tmp_path / "push-now"
        conn = await asyncio.to_thread(Line, ext, N1, PUSH_NP)
        dgram = udp_session(ext)
        try:
            first = await asyncio.to_thread(udp_ask, dgram, "before")
            conn.send(f"wait {flag}")
            port = conn.sock.getsockname()[1]

            # malformed frames from the node network, straight to n1's eth0
            bad = malformed(LAN)
            await asyncio.to_thread(send_frames, lan, "lan0", mac(c.node(1), "eth0"), list(bad.values()), 50)
            assert lan_entries(pins, LAN) == []

            # TTL 1: time exceeded comes back from the frontend, quoting the SYN as sent
            with packets.sniffer(lan, socket.IPPROTO_ICMP) as sniff, packets.RawSender(lan) as sender:
                syn = packets.tcp(LAN, N1, 45000, PUSH_NP, packets.TCP_SYN, seq=7)
                sender.send(packets.ipv4(LAN, N1, socket.IPPROTO_TCP, syn, ttl=1))
                for src in (N1, "127.0.0.1"):  # replies with nowhere to go
                    sender.send(packets.ipv4(src, N1, socket.IPPROTO_TCP, packets.tcp(src, N1, PUSH_NP, PUSH_NP, packets.TCP_SYN)))
                seen = await asyncio.to_thread(packets.sniffed, sniff, 2.0)
            exceeded = [p for p in seen if p.icmp == (11, 0)]
            assert exceeded, seen
            quote = packets.parse(exceeded[0].raw[28:])
            assert (exceeded[0].src, quote.src, quote.dst, quote.sport, quote.dport) == (N1, LAN, N1, 45000, PUSH_NP), exceeded

            # from outside: ICMP errors about the live flow, fragments without a first one
            await asyncio.to_thread(icmp_storm, ext, port, 20_000)
            await asyncio.to_thread(fragment_storm, ext, 10_000)
            assert await asyncio.to_thread(options_connection, ext) == "push-b with options"

            # a client port reused at once after the server closed: a new flow, not the closing one
            nsexec(c.ns("push-b"), "sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0")
            reused = await asyncio.to_thread(closed_and_reopened, ext, 47000)
            reused.send(f"wait {flag}")

            # a forged RST from the client's side, then silence past the closing timeout
            rst = packets.tcp(EXT, N1, port, PUSH_NP, packets.TCP_RST, seq=random.getrandbits(32))
            with packets.RawSender(ext) as sender:
                sender.send(packets.ipv4(EXT, N1, socket.IPPROTO_TCP, rst))
            await asyncio.sleep(12)

            flag.touch()
            assert await asyncio.to_thread(conn.line) == "pushed"
            assert await asyncio.to_thread(reused.line) == "pushed"
            reused.close()
            assert await asyncio.to_thread(conn.ask, "after the attacks") == "after the attacks"
            assert await asyncio.to_thread(udp_ask, dgram, "after") == first
        finally:
            conn.close()
            dgram.close()
        assert tc_programs(c.node(1), "eth0") == programs
        assert c.agents[1].poll() is None
