"""Hand-made IPv4 packets for the attack tests, with struct only (no scapy): headers with IP
options, TCP, UDP and ICMP errors with correct checksums, a raw sender and a sniffer that live in
a network namespace, and floods of spoofed packets from one process.

Raw sockets are opened inside the namespace (`inside`), then used from the calling thread
anywhere: a socket stays in the namespace it was created in. The sender is IPPROTO_RAW, so the
packet is sent as given (IP_HDRINCL): any source address, any option; the kernel fills in the IP
header checksum and total length.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.netns import inside

TCP_FIN, TCP_SYN, TCP_RST, TCP_PSH, TCP_ACK = 0x01, 0x02, 0x04, 0x08, 0x10
DF = 0x4000
MF = 0x2000
DSR_OPT_TYPE = 0x9A  # usproxy's (and Cilium's) DSR option: copied, control class, number 26


def csum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of `data`."""
    if len(data) % 2:
        data += b"\0"
    s: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def aton(ip: str) -> bytes:
    return socket.inet_aton(ip)


def dsr_option(addr: str, port: int) -> bytes:
    """The 8-byte DSR option naming `addr`:`port` (dsr.h struct dsr_opt)."""
    return struct.pack("!BBH4s", DSR_OPT_TYPE, 8, port, aton(addr))


def ipv4(src: str, dst: str, proto: int, payload: bytes, *, options: bytes = b"", ttl: int = 64,
         ident: int = 0, frag: int = DF) -> bytes:
    """An IPv4 header (checksum filled in) + `payload`; `frag` is the flags/offset field."""
    options += b"\0" * (-len(options) % 4)
    ihl = 5 + len(options) // 4
    head = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 4 * ihl + len(payload), ident, frag, ttl, proto, 0,
                       aton(src), aton(dst)) + options
    return head[:10] + struct.pack("!H", csum(head)) + head[12:] + payload


def _pseudo(src: str, dst: str, proto: int, length: int) -> bytes:
    return aton(src) + aton(dst) + struct.pack("!BBH", 0, proto, length)


def tcp(src: str, dst: str, sport: int, dport: int, flags: int, *, seq: int = 1, ack: int = 0,
        payload: bytes = b"", window: int = 64240) -> bytes:
    """A TCP segment (20-byte header, checksum over the pseudo header)."""
    head = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, window, 0, 0)
    c = csum(_pseudo(src, dst, socket.IPPROTO_TCP, len(head) + len(payload)) + head + payload)
    return head[:16] + struct.pack("!H", c) + head[18:] + payload


def udp(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    length = 8 + len(payload)
    head = struct.pack("!HHHH", sport, dport, length, 0)
    c = csum(_pseudo(src, dst, socket.IPPROTO_UDP, length) + head + payload) or 0xFFFF
    return head[:6] + struct.pack("!H", c) + payload


def icmp(kind: int, code: int, rest: int, body: bytes) -> bytes:
    """An ICMP message: type, code, checksum, the 4-byte rest of header (the MTU for
    fragmentation needed), then `body` (an error's: the offending packet's first bytes)."""
    head = struct.pack("!BBHI", kind, code, 0, rest)
    return head[:2] + struct.pack("!H", csum(head + body)) + head[4:] + body


@dataclass(frozen=True)
class Parsed:
    """What the sniffer saw of one IPv4 packet."""

    src: str
    dst: str
    proto: int
    ttl: int
    sport: int
    dport: int
    flags: int  # TCP flags (0 for others)
    icmp: tuple[int, int] | None  # (type, code) of an ICMP message
    raw: bytes


def parse(raw: bytes) -> Parsed:
    ihl = (raw[0] & 0x0F) * 4
    proto, ttl = raw[9], raw[8]
    src, dst = socket.inet_ntoa(raw[12:16]), socket.inet_ntoa(raw[16:20])
    l4 = raw[ihl:]
    sport = dport = flags = 0
    kind = None
    if proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP) and len(l4) >= 4:
        sport, dport = struct.unpack("!HH", l4[:4])
        if proto == socket.IPPROTO_TCP and len(l4) >= 14:
            flags = l4[13]
    elif proto == socket.IPPROTO_ICMP and len(l4) >= 2:
        kind = (l4[0], l4[1])
    return Parsed(src, dst, proto, ttl, sport, dport, flags, kind, raw)


class RawSender:
    """An IPPROTO_RAW socket of namespace `ns`: sends hand-made IPv4 packets as they are."""

    def __init__(self, ns: str) -> None:
        with inside(ns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    def send(self, packet: bytes) -> None:
        self.sock.sendto(packet, (socket.inet_ntoa(packet[16:20]), 0))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def sniffer(ns: str, proto: int) -> Iterator[socket.socket]:
    """A raw socket of namespace `ns` that receives a copy of every `proto` packet addressed to
    one of its addresses (read with `sniffed`)."""
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    try:
        yield s
    finally:
        s.close()


def sniffed(s: socket.socket, seconds: float) -> list[Parsed]:
    """Every packet the sniffer `s` receives within `seconds`."""
    out: list[Parsed] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            out.append(parse(s.recv(65535)))
        except (TimeoutError, socket.timeout):
            break
    return out


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def flood_tcp(ns: str, dst: str, dport: int, count: int, flags: int, sources: str = "203.0.113.128/25",
              seed: int = 1) -> float:
    """`count` TCP segments with `flags` (SYN, ACK, ...) to `dst`:`dport` from spoofed sources
    (every address of `sources` in turn, a random port each, a random sequence and acknowledgment
    number), correct checksums; returns the seconds it took. One process, one raw socket: the
    checksum is updated per packet from a precomputed sum of the fixed words."""
    import ipaddress

    rnd = random.Random(seed)
    addrs = [int(a) for a in ipaddress.IPv4Network(sources)]
    d = int.from_bytes(aton(dst), "big")
    fixed = (d >> 16) + (d & 0xFFFF) + socket.IPPROTO_TCP + 20 + dport + (5 << 12 | flags) + 64240
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, DF, 64, socket.IPPROTO_TCP, 0, b"\0" * 4, aton(dst)))
    seg = bytearray(struct.pack("!HHIIBBHHH", 0, dport, 0, 0, 5 << 4, flags, 64240, 0, 0))
    pkt = bytearray(40)
    target = (dst, 0)
    start = time.monotonic()
    with RawSender(ns) as sender:
        for i in range(count):
            a = addrs[i % len(addrs)]
            sport = rnd.randrange(1024, 65536)
            seq, ack = rnd.getrandbits(32), rnd.getrandbits(32) if flags & TCP_ACK else 0
            s = fixed + (a >> 16) + (a & 0xFFFF) + sport + (seq >> 16) + (seq & 0xFFFF) + (ack >> 16) + (ack & 0xFFFF)
            struct.pack_into("!I", ip, 12, a)
            struct.pack_into("!HHII", seg, 0, sport, dport, seq, ack)
            struct.pack_into("!H", seg, 16, _fold(s))
            pkt[:20], pkt[20:] = ip, seg
            try:
                sender.sock.sendto(pkt, target)
            except (BlockingIOError, OSError):
                pass  # a full queue drops, as a wire would
    return time.monotonic() - start


def flood_udp(ns: str, dst: str, dport: int, count: int, sources: str = "203.0.113.128/25") -> float:
    """`count` one-datagram UDP flows to `dst`:`dport` from spoofed sources (every address of
    `sources` in turn, then the next source port: no tuple twice below len(sources) * 64000)."""
    import ipaddress

    addrs = [int(a) for a in ipaddress.IPv4Network(sources)]
    payload = b"flood!"
    d = int.from_bytes(aton(dst), "big")
    length = 8 + len(payload)
    fixed = (d >> 16) + (d & 0xFFFF) + socket.IPPROTO_UDP + 2 * length + dport + (~csum(payload) & 0xFFFF)
    pkt = bytearray(ipv4("0.0.0.0", dst, socket.IPPROTO_UDP, udp("0.0.0.0", dst, 1, dport, payload)))
    target = (dst, 0)
    start = time.monotonic()
    with RawSender(ns) as sender:
        for i in range(count):
            a = addrs[i % len(addrs)]
            sport = 1024 + (i // len(addrs)) % 64000
            struct.pack_into("!I", pkt, 12, a)
            struct.pack_into("!H", pkt, 20, sport)
            struct.pack_into("!H", pkt, 26, _fold(fixed + (a >> 16) + (a & 0xFFFF) + sport) or 0xFFFF)
            try:
                sender.sock.sendto(pkt, target)
            except (BlockingIOError, OSError):
                pass
    return time.monotonic() - start
