"""Map layout of the socket LB: the byte form of every key and value in sock_lb.c.

This module and the structs at the top of sock_lb.c describe the same bytes; change both together
and bump LAYOUT_VERSION (pinned maps live under a directory named after it, so a new layout never
reuses maps of an old one). Host byte order is little-endian (x86_64); addresses are 16 bytes in
network order with IPv4 held as v4-mapped IPv6; ports are network order in the low 16 bits of a u32.

Maps (the shape follows Cilium's bpf/lib/lb.h: a service entry with a count, numbered backend
slots, backends by id, affinity by client netns, reverse entries by socket cookie):

  usp_services  frontend (addr, port, proto)  -> count, service id, affinity timeout, flags, rr
  usp_slots     (service id, slot 1..count)   -> backend id
  usp_backends  backend id                    -> addr, port, service id, times selected
  usp_affinity  (client netns cookie, svc id) -> last use (monotonic ns), backend id   [LRU]
  usp_revnat    (socket cookie, backend)      -> frontend, service id                  [LRU]
  usp_flows     socket cookie                 -> the socket's steering (for `usproxy flows`) [LRU]
  usp_maglev    service id                    -> inner array of MAGLEV_M backend ids
  usp_names     service id                    -> ServicePortName key text (for read-back)
  usp_backend_ids (service id, addr, port)    -> backend id (dsr.h: is a destination a backend of it)
  usp_ct        packet tuple + direction      -> NAT of a confirmed TCP flow at tc      [LRU]
  usp_ct_any    packet tuple + direction      -> NAT of a confirmed UDP flow at tc      [LRU]
  usp_ct_new    packet tuple + direction      -> NAT of a flow not yet confirmed, the reply's seq [LRU]
  usp_frags     (src, dst, IP id, protocol)   -> the ports of a first fragment          [LRU]
  usp_tc_addrs  IPv4 address                  -> ifindex: addresses that serve NodePorts
  usp_tc_ifaces ifindex                       -> IPv4 address: hooked interfaces (SNAT source)
  usp_tc_sources (service id, IPv4 prefix)    -> 1: loadBalancerSourceRanges of an LB IP group [LPM]
  usp_dsr_peers IPv4 prefix                   -> 1: the node networks DSR peers are in   [LPM]

A NodePort is a usp_services entry at NODEPORT_ANY (0.0.0.0): the tc programs look it up by
port and protocol for packets to any usp_tc_addrs address. LoadBalancer IPs and externalIPs are
entries of their own flagged F_TC_ONLY (the socket LB skips them); tc_frontends.h says how the tc
programs admit them.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from usproxy.model.types import IPAddress, Protocol

LAYOUT_VERSION = 1
MAGLEV_M = 16381
NAME_SIZE = 256

F_AFFINITY = 1 << 0
F_MAGLEV = 1 << 1
F_ROUND_ROBIN = 1 << 2
F_LOCAL_ONLY = 1 << 3  # NodePort, externalTrafficPolicy Local: the tc program never SNATs
F_TC_ONLY = 1 << 8  # a frontend of the tc programs only: the socket LB never translates it
F_SOURCE_RANGES = 1 << 9  # LB IP group with loadBalancerSourceRanges: usp_tc_sources filters
F_DROP_EMPTY = 1 << 10  # count 0 for want of a local endpoint (eTP Local): tc drops, never refuses
F_LB_IPS = 1 << 11  # not read by the programs: marks a ServicePort's LoadBalancer IP group (read-back)
F_DSR = 1 << 12  # tc frontend in --bpf-lb-mode dsr (dsr.h): a backend on another node answers directly
NODEPORT_ANY = ipaddress.IPv4Address("0.0.0.0")
CT_ORIGINAL, CT_REPLY = 0, 1
CT_DSR = 1 << 1  # ct flag (dsr.h): a DSR flow; its reply does not come back through this node
CT_SEEN_REPLY = 1 << 2  # usp_ct_new flag: a reply passed (the flow is confirmed by the client's next packet)

PROTO_NUMBERS: dict[str, int] = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}
PROTO_NAMES: dict[int, Protocol] = {socket.IPPROTO_TCP: "TCP", socket.IPPROTO_UDP: "UDP"}

_V4_PREFIX = b"\0" * 10 + b"\xff\xff"


def pack_addr(ip: IPAddress) -> bytes:
    """16 bytes: IPv6 as is, IPv4 as ::ffff:a.b.c.d."""
    if isinstance(ip, ipaddress.IPv4Address):
        return _V4_PREFIX + ip.packed
    return ip.packed


def unpack_addr(raw: bytes) -> IPAddress:
    if raw[:12] == _V4_PREFIX:
        return ipaddress.IPv4Address(raw[12:16])
    return ipaddress.IPv6Address(raw[:16])


def pack_port(port: int) -> bytes:
    """A port as struct bpf_sock_addr holds it: network order in the low half of a u32."""
    return struct.pack(">H", port) + b"\0\0"


def unpack_port(raw: bytes) -> int:
    return int(struct.unpack(">H", raw[:2])[0])


@dataclass(frozen=True, slots=True, order=True)
class SvcKey:
    """A frontend: struct svc_key (24 bytes)."""

    ip: IPAddress
    port: int
    proto: int

    SIZE = 24

    def pack(self) -> bytes:
        return pack_addr(self.ip) + pack_port(self.port) + struct.pack("<I", self.proto)

    @classmethod
    def unpack(cls, raw: bytes) -> SvcKey:
        return cls(unpack_addr(raw[:16]), unpack_port(raw[16:20]), struct.unpack("<I", raw[20:24])[0])


@dataclass(frozen=True, slots=True)
class SvcVal:
    """struct svc_val (24 bytes). `rr` is the kernel's counter; writes set it to 0."""

    count: int
    id: int
    affinity_timeout: int
    flags: int

    SIZE = 24
    _FMT = "<IIIIII"

    def pack(self) -> bytes:
        return struct.pack(self._FMT, self.count, self.id, self.affinity_timeout, self.flags, 0, 0)

    @classmethod
    def unpack(cls, raw: bytes) -> SvcVal:
        count, sid, timeout, flags, _rr, _pad = struct.unpack(cls._FMT, raw)
        return cls(count, sid, timeout, flags)


def pack_slot_key(svc_id: int, slot: int) -> bytes:
    return struct.pack("<II", svc_id, slot)


def unpack_slot_key(raw: bytes) -> tuple[int, int]:
    sid, slot = struct.unpack("<II", raw)
    return int(sid), int(slot)


def pack_backend_key(svc_id: int, ip: IPAddress, port: int) -> bytes:
    """struct backend_key (24 bytes): a usp_backend_ids key."""
    return struct.pack("<I", svc_id) + pack_port(port) + pack_addr(ip)


BACKEND_KEY_SIZE = 24


def pack_u32(value: int) -> bytes:
    return struct.pack("<I", value)


def unpack_u32(raw: bytes) -> int:
    return int(struct.unpack("<I", raw[:4])[0])


@dataclass(frozen=True, slots=True)
class BackendVal:
    """struct backend_val (32 bytes). `selected` counts the kernel's choices of this backend."""

    ip: IPAddress
    port: int
    svc_id: int
    selected: int = 0

    SIZE = 32

    def pack(self) -> bytes:
        return pack_addr(self.ip) + pack_port(self.port) + struct.pack("<IQ", self.svc_id, 0)

    @classmethod
    def unpack(cls, raw: bytes) -> BackendVal:
        sid, selected = struct.unpack("<IQ", raw[20:32])
        return cls(unpack_addr(raw[:16]), unpack_port(raw[16:20]), sid, selected)


@dataclass(frozen=True, slots=True)
class AffinityEntry:
    """struct affinity_key + struct affinity_val (16 + 16 bytes)."""

    client: int
    svc_id: int
    last_used: int
    backend_id: int

    KEY_SIZE = 16
    VAL_SIZE = 16

    def pack_key(self) -> bytes:
        return struct.pack("<QII", self.client, self.svc_id, 0)

    def pack_val(self) -> bytes:
        return struct.pack("<QII", self.last_used, self.backend_id, 0)

    @classmethod
    def unpack(cls, key: bytes, val: bytes) -> AffinityEntry:
        client, sid, _ = struct.unpack("<QII", key)
        last, bid, _ = struct.unpack("<QII", val)
        return cls(client, sid, last, bid)


REVNAT_KEY_SIZE = 32
REVNAT_VAL_SIZE = 24


@dataclass(frozen=True, slots=True)
class FlowVal:
    """struct flow_val (88 bytes): one socket the programs steered, keyed by socket cookie."""

    created: int
    last: int
    netns: int
    packets: int
    svc_id: int
    backend_id: int
    proto: int
    svc_ip: IPAddress
    svc_port: int
    be_ip: IPAddress
    be_port: int

    KEY_SIZE = 8
    SIZE = 88

    @classmethod
    def unpack(cls, raw: bytes) -> FlowVal:
        created, last, netns, packets, sid, bid, proto = struct.unpack("<QQQQIII", raw[:44])
        return cls(created, last, netns, packets, sid, bid, proto,
                   unpack_addr(raw[48:64]), unpack_port(raw[44:48]),
                   unpack_addr(raw[64:80]), unpack_port(raw[80:84]))


def pack_name(text: str) -> bytes:
    data = text.encode()[: NAME_SIZE - 1]
    return data + b"\0" * (NAME_SIZE - len(data))


def unpack_name(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


@dataclass(frozen=True, slots=True)
class CtEntry:
    """struct ct_key + struct ct_val (16 + 48 bytes): one direction of a NodePort flow at tc.

    ORIGINAL: the client's packet (client -> node:NodePort) becomes (snat or client) -> backend;
    REPLY: the backend's packet becomes node:NodePort -> client. `nat_*` are the rewritten
    fields (an ORIGINAL entry's nat_saddr is 0.0.0.0 when the flow is not SNATed)."""

    saddr: ipaddress.IPv4Address
    daddr: ipaddress.IPv4Address
    sport: int
    dport: int
    proto: int
    direction: int
    nat_saddr: ipaddress.IPv4Address
    nat_daddr: ipaddress.IPv4Address
    nat_sport: int
    nat_dport: int
    svc_id: int
    backend_id: int
    flags: int
    created: int
    last: int
    packets: int
    confirmed: bool = True  # False: an entry of usp_ct_new (the flow is not confirmed yet)

    KEY_SIZE = 16
    VAL_SIZE = 48

    @classmethod
    def unpack(cls, key: bytes, val: bytes, confirmed: bool = True) -> CtEntry:
        """An entry from its key and value (a usp_ct_new value: its struct ct_val part)."""
        s, d, sp, dp, proto, direction = struct.unpack("!4s4sHHBB", key[:14])
        ns, nd, nsp, ndp = struct.unpack("!4s4sHH", val[:12])
        sid, bid, flags, created, last, packets = struct.unpack("<IIIQQQ", val[12:48])
        v4 = ipaddress.IPv4Address
        return cls(v4(s), v4(d), sp, dp, proto, direction, v4(ns), v4(nd), nsp, ndp, sid, bid, flags,
                   created, last, packets, confirmed)


# The tc conntrack tables (sock_lb.c) and the size of their values: confirmed TCP flows, confirmed
# flows of other protocols (UDP), and flows not yet confirmed (struct ct_new_val: ct_val + the
# sequence number of the reply's SYN-ACK). Every key is a struct ct_key.
CT_MAPS: dict[str, int] = {"usp_ct": 48, "usp_ct_any": 48, "usp_ct_new": 56}
CT_PENDING = "usp_ct_new"

SRC_RANGE_KEY_SIZE = 12


def pack_src_range(svc_id: int, net: ipaddress.IPv4Network) -> bytes:
    """struct src_range_key (12 bytes): an LPM trie key matching the service id in full, then
    `net`'s prefix of the source address."""
    return struct.pack("<II", 32 + net.prefixlen, svc_id) + net.network_address.packed


PEER_KEY_SIZE = 8


def pack_peer_net(net: ipaddress.IPv4Network) -> bytes:
    """struct peer_key (8 bytes): a usp_dsr_peers key, the prefix length then the network."""
    return struct.pack("<I", net.prefixlen) + net.network_address.packed


def unpack_peer_net(raw: bytes) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network((raw[4:8], struct.unpack("<I", raw[:4])[0]))


def unpack_src_range(raw: bytes) -> tuple[int, ipaddress.IPv4Network]:
    """(service id, source range) of a usp_tc_sources key."""
    bits, sid = struct.unpack("<II", raw[:8])
    return int(sid), ipaddress.IPv4Network((raw[8:12], int(bits) - 32))
