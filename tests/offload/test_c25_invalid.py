"""Field case C25 against the real kernel: out-of-window packets on an offloaded NAT path must not
turn into resets (fault class: conntrack INVALID handling on offloaded NAT paths, kubernetes
issue 74839).

A ClusterIP is DNATed by NftablesDatapath in a throwaway node namespace to an endpoint namespace
that serves a known payload; a client namespace downloads it through the ClusterIP. The field
case impairs the path with netem (reorder, duplicate) until some segment from the endpoint falls
outside the window conntrack tracks. This kernel has no sch_netem, so the test produces that
packet directly and deterministically instead: while the download runs, the endpoint namespace
sends crafted segments on the connection's 4-tuple (endpoint ip:port -> client ip:port) through
a raw socket, with a sequence number 2**30 past the endpoint's ISN (over conntrack's upper bound:
"SEQ is over upper bound", so INVALID; a sequence below the window would only be IGNOREd, and
NATed) and the ACK field equal to the client's snd_nxt. The ISNs and the client port come from
sniffing the handshake with an AF_PACKET socket in the client namespace.

An INVALID packet has no conntrack entry, so it is not reverse-NATed: if the node forwards it,
the client gets a segment from the endpoint address, which no socket of its own matches, and
answers with a RST to the endpoint whose sequence is the injected ACK field, i.e. exactly the
server's rcv_nxt, and the server's connection is reset (RFC 5961 accepts an exact match).
usproxy's table drops `ct state invalid` on forward (the bridge path here goes through it with
br_netfilter), so:

- test_c25_invalid_segments_are_dropped: every download completes with the right sha256, no
  ECONNRESET, the client namespace sends no RST, and node conntrack counted the injections as
  invalid (so the injection really was the fault class, not a no-op);
- test_c25_control_without_invalid_drop: the same with the rule removed from the kernel table
  shows the fault (client RSTs, the server connection reset, the download broken), proving the
  first test can fail.
"""

from __future__ import annotations

import hashlib
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from usproxy.offload.nftables.datapath import NftablesDatapath

from tests.netns import Topology, inside, nsexec
from tests.offload.helpers import ep, spn, state

pytestmark = pytest.mark.netns

VIP = "10.96.25.25"
EP_IP, EP_PORT = "10.244.1.25", 8080
CLI_IP = "10.244.9.25"
WEB = spn("c25", "http")
SIZE = 16 << 20  # per download
CHUNK = 256 << 10  # the server injects after each chunk it hands to the kernel
SEQ_AHEAD = 1 << 30  # far over any receive window, still "after" in 32-bit sequence space
ETH_P_ALL = 0x0003  # outgoing frames reach only ETH_P_ALL taps
TH_RST, TH_SYN, TH_PSH, TH_ACK = 0x04, 0x02, 0x08, 0x10


@pytest.fixture
def dp(topology: Topology) -> Iterator[NftablesDatapath]:
    nsexec(topology.node, "ip", "route", "add", "10.96.0.0/16", "dev", "usbr0")
    # the default, pinned: be_liberal would ACCEPT out-of-window segments and hide the fault class
    nsexec(topology.node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=0")
    d = NftablesDatapath(netns=topology.node)
    try:
        yield d
    finally:
        d.close()


# -- packets ---------------------------------------------------------------------------------------
def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def tcp_segment(src: str, sport: int, dst: str, dport: int, seq: int, ack: int, flags: int,
                payload: bytes = b"") -> bytes:
    """An IPv4 packet (header included, both checksums right) carrying one TCP segment."""
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, 5 << 4, flags,
                      502, 0, 0) + payload
    pseudo = s + d + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), random.getrandbits(16), 0x4000, 64,
                     socket.IPPROTO_TCP, 0, s, d)
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return ip + tcp


@dataclass(frozen=True)
class Handshake:
    cport: int
    client_isn: int
    server_isn: int


def sniff_handshake(sniffer: socket.socket, cport: int, timeout: float = 5.0) -> Handshake:
    """The client's SYN and the (reverse-NATed) SYN-ACK of the connection from `cport` to VIP:80,
    read from an AF_PACKET socket opened in the client namespace before connecting."""
    vip = socket.inet_aton(VIP)
    client_isn = server_isn = None
    deadline = time.monotonic() + timeout
    while client_isn is None or server_isn is None:
        sniffer.settimeout(max(deadline - time.monotonic(), 0.01))
        frame = sniffer.recv(256)  # raises TimeoutError past the deadline
        ip = frame[14:]
        if frame[12:14] != b"\x08\x00" or len(ip) < 40 or ip[9] != socket.IPPROTO_TCP:
            continue
        tcp = ip[(ip[0] & 0x0F) * 4:]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        flags = tcp[13]
        if flags & TH_SYN and not flags & TH_ACK and ip[16:20] == vip and (sport, dport) == (cport, 80):
            client_isn = seq
        elif flags & TH_SYN and flags & TH_ACK and ip[12:16] == vip and (sport, dport) == (80, cport):
            server_isn = seq
    return Handshake(cport, client_isn, server_isn)


def out_rsts(ns: str) -> int:
    """Tcp OutRsts of namespace `ns` (/proc/net/snmp is per network namespace)."""
    lines = [ln.split() for ln in nsexec(ns, "cat", "/proc/net/snmp").stdout.splitlines() if ln.startswith("Tcp:")]
    return int(lines[1][lines[0].index("OutRsts")])


def ct_invalid(ns: str) -> int:
    """conntrack's `invalid` counter in `ns`, summed over CPUs."""
    rows = [ln.split() for ln in nsexec(ns, "cat", "/proc/net/stat/nf_conntrack").stdout.splitlines()]
    col = rows[0].index("invalid")
    return sum(int(r[col], 16) for r in rows[1:])


# -- one download ----------------------------------------------------------------------------------
@dataclass
class Download:
    sha256: str = ""
    received: int = 0
    error: BaseException | None = None  # what the client's recv raised
    server_error: BaseException | None = None  # what the server's send raised
    injected: int = 0
    handshake: Handshake | None = None
    server_log: list[str] = field(default_factory=list)


class Server:
    """One-connection-at-a-time server in the endpoint namespace: on accept it waits for the
    handshake the client sniffed, then sends the payload in chunks and, after each, injects an
    out-of-window segment on the connection's 4-tuple (from the endpoint address, so the node
    sees it as the endpoint's reply direction)."""

    def __init__(self, ns: str, payload: bytes) -> None:
        self.payload = payload
        with inside(ns):
            self.listener = socket.socket()
            self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((EP_IP, EP_PORT))
        self.listener.listen(8)
        self.raw.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)

    def serve_one(self, dl: Download, ready: threading.Event) -> None:
        conn = None
        try:
            self.listener.settimeout(10)
            conn, peer = self.listener.accept()
            if not ready.wait(10) or dl.handshake is None:
                dl.server_log.append("no handshake sniffed")
                return
            hs = dl.handshake
            assert peer == (CLI_IP, hs.cport), (peer, hs)
            for off in range(0, len(self.payload), CHUNK):
                conn.sendall(self.payload[off:off + CHUNK])
                self.inject(hs, dl.injected)
                dl.injected += 1
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(10)
            conn.recv(1)  # the client's FIN (or its reset)
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            dl.server_error = e
        finally:
            if conn is not None:
                conn.close()

    def inject(self, hs: Handshake, i: int) -> None:
        seq = hs.server_isn + 1 + SEQ_AHEAD + i * 1000
        pkt = tcp_segment(EP_IP, EP_PORT, CLI_IP, hs.cport, seq, hs.client_isn + 1, TH_PSH | TH_ACK, b"x" * 100)
        self.raw.sendto(pkt, (CLI_IP, 0))

    def close(self) -> None:
        self.listener.close()
        self.raw.close()


def download(cli: str, server: Server, timeout: float = 5.0) -> Download:
    dl = Download()
    ready = threading.Event()
    t = threading.Thread(target=server.serve_one, args=(dl, ready), daemon=True)
    t.start()
    with inside(cli):
        sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s = socket.socket()
    try:
        sniffer.bind(("eth0", ETH_P_ALL))
        s.bind((CLI_IP, 0))
        s.settimeout(timeout)
        s.connect((VIP, 80))
        try:
            dl.handshake = sniff_handshake(sniffer, s.getsockname()[1])
        finally:
            sniffer.close()
            ready.set()
        h = hashlib.sha256()
        try:
            while data := s.recv(1 << 16):
                h.update(data)
                dl.received += len(data)
        except OSError as e:
            dl.error = e
        dl.sha256 = h.hexdigest()
    finally:
        s.close()
        t.join(15)
    assert not t.is_alive()
    return dl


async def serve(topology: Topology, dp: NftablesDatapath) -> tuple[str, str]:
    epns = topology.add_host("ep", EP_IP)
    cli = topology.add_host("cli", CLI_IP)
    await dp.apply({WEB: state(WEB, VIP, 80, [ep(EP_IP, EP_PORT)])})
    return epns, cli


# -- tests -----------------------------------------------------------------------------------------
async def test_c25_invalid_segments_are_dropped(topology: Topology, dp: NftablesDatapath) -> None:
    epns, cli = await serve(topology, dp)
    ruleset = nsexec(topology.node, "nft", "list", "chain", "ip", "usproxy", "filter-forward").stdout
    assert "ct state invalid drop" in ruleset
    payload = random.Random(25).randbytes(SIZE)
    want = hashlib.sha256(payload).hexdigest()
    server = Server(epns, payload)
    try:
        rsts, invalid = out_rsts(cli), ct_invalid(topology.node)
        results = [download(cli, server) for _ in range(3)]
        rsts_after, invalid_after = out_rsts(cli), ct_invalid(topology.node)
    finally:
        server.close()
    for dl in results:
        assert dl.error is None, dl
        assert dl.server_error is None, dl
        assert (dl.received, dl.sha256) == (SIZE, want)
        assert dl.injected == SIZE // CHUNK
    assert rsts_after - rsts == 0
    # every injected segment was INVALID to the node's conntrack (and dropped, as no RST came back)
    assert invalid_after - invalid >= sum(dl.injected for dl in results)


async def test_c25_control_without_invalid_drop(topology: Topology, dp: NftablesDatapath) -> None:
    epns, cli = await serve(topology, dp)
    nsexec(topology.node, "nft", "flush", "chain", "ip", "usproxy", "filter-forward")
    nsexec(topology.node, "nft", "add", "rule", "ip", "usproxy", "filter-forward", "ct", "state", "new",
           "jump", "endpoints-check")
    assert "invalid" not in nsexec(topology.node, "nft", "list", "chain", "ip", "usproxy", "filter-forward").stdout
    payload = random.Random(25).randbytes(SIZE)
    want = hashlib.sha256(payload).hexdigest()
    server = Server(epns, payload)
    try:
        rsts = out_rsts(cli)
        dl = download(cli, server, timeout=3.0)
        rsts_after = out_rsts(cli)
    finally:
        server.close()
    assert dl.injected >= 1, dl
    assert rsts_after - rsts >= 1, dl  # the client answered the un-NATed segment with a RST
    assert isinstance(dl.server_error, ConnectionResetError), dl  # ... which reset the server
    # and the download broke: the client stalls (the server forgot the connection) or is reset
    assert isinstance(dl.error, (TimeoutError, ConnectionResetError)), dl
    assert dl.received < SIZE and dl.sha256 != want
