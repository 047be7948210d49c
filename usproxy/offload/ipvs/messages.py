"""IPVS generic netlink messages with `struct`: new virtual and real servers packed, dumps read.

A cold sync of 10,000 Services sends 10,000 virtual and 20,000 real servers. pyroute2 builds each
request from its message classes in ~0.25 ms of CPU and waits for each answer in a round trip of
its own; these are the same bytes (tests/offload/ipvs/test_messages.py holds them equal to
pyroute2's), built in microseconds and sent many to a system call by util/netlink_batch.py.

The layout is the kernel's (include/uapi/linux/ip_vs.h, net/netfilter/ipvs/ip_vs_ctl.c): a
nlmsghdr whose type is the IPVS family's id, a genlmsghdr (command, version 1), then
IPVS_CMD_ATTR_SERVICE and, for a real server, IPVS_CMD_ATTR_DEST, each a nested attribute (sent
without NLA_F_NESTED, as pyroute2 and ipvsadm send them). Numbers in host order but the ports,
which are in network order; an IPv4 address is 4 bytes, an IPv6 one 16. A new virtual server
carries every attribute the kernel requires of a full entry (scheduler, flags with their mask,
timeout, netmask), a new real server the tunnel attributes, thresholds, weight, forwarding method
and address family, as pyroute2's IPVSDest does.

A restart reads every virtual server back, and each one's real servers in a dump of its own
(IPVS has no dump of every real server): 10,000 round trips, which through pyroute2's message
classes cost ~1 ms of CPU each. Dumped, an address is the kernel's 16-byte union whatever the
family (IPVS_SVC_ATTR_AF and IPVS_DEST_ATTR_ADDR_FAMILY say which), a flags attribute is the
flags word and its mask, and nested attributes may carry NLA_F_NESTED: types are read masked.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Mapping

from usproxy.model.types import IPAddress
from usproxy.util.netlink_batch import NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST

IPVS_CMD_NEW_SERVICE, IPVS_CMD_NEW_DEST = 1, 5
IPVS_CMD_ATTR_SERVICE, IPVS_CMD_ATTR_DEST = 1, 2
SVC_AF, SVC_PROTOCOL, SVC_ADDR, SVC_PORT, SVC_SCHED, SVC_FLAGS, SVC_TIMEOUT, SVC_NETMASK = 1, 2, 3, 4, 6, 7, 8, 9
DEST_ADDR, DEST_PORT, DEST_FWD, DEST_WEIGHT, DEST_U_THRESH, DEST_L_THRESH = 1, 2, 3, 4, 5, 6
DEST_AF, DEST_TUN_TYPE, DEST_TUN_PORT, DEST_TUN_FLAGS = 11, 13, 14, 15
GENL_VERSION = 1
CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL

_NLMSGHDR = struct.Struct("=IHHII")
_GENLMSGHDR = struct.Struct("=BBH")
_U16, _U32, _PORT = struct.Struct("=H"), struct.Struct("=I"), struct.Struct("!H")
Key = tuple[int, IPAddress, int]  # protocol number, address, port


def _nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length & 3)


def _af(version: int) -> bytes:
    return _U16.pack(socket.AF_INET if version == 4 else socket.AF_INET6)


def netmask(version: int) -> int:
    """The netmask attribute's value: all ones for IPv4, the prefix length 128 for IPv6."""
    return 0xFFFFFFFF if version == 4 else 128


def service_key_attrs(key: Key) -> bytes:
    """The attributes that name a virtual server: family, protocol, address, port."""
    protocol, address, port = key
    return (_nla(SVC_AF, _af(address.version)) + _nla(SVC_PROTOCOL, _U16.pack(protocol))
            + _nla(SVC_ADDR, address.packed) + _nla(SVC_PORT, _PORT.pack(port)))


def service_attrs(key: Key, scheduler: str, flags: int, timeout: int) -> bytes:
    """A virtual server's full entry."""
    return (service_key_attrs(key) + _nla(SVC_SCHED, scheduler.encode() + b"\0")
            + _nla(SVC_FLAGS, struct.pack("=II", flags, 0xFFFFFFFF)) + _nla(SVC_TIMEOUT, _U32.pack(timeout))
            + _nla(SVC_NETMASK, _U32.pack(netmask(key[1].version))))


def dest_attrs(address: IPAddress, port: int, weight: int, fwd: int) -> bytes:
    return (_nla(DEST_TUN_TYPE, b"\0") + _nla(DEST_TUN_PORT, _PORT.pack(0)) + _nla(DEST_TUN_FLAGS, _U16.pack(0))
            + _nla(DEST_U_THRESH, _U32.pack(0)) + _nla(DEST_L_THRESH, _U32.pack(0))
            + _nla(DEST_ADDR, address.packed) + _nla(DEST_PORT, _PORT.pack(port))
            + _nla(DEST_WEIGHT, _U32.pack(weight)) + _nla(DEST_FWD, _U32.pack(fwd))
            + _nla(DEST_AF, _af(address.version)))


def _request(family: int, seq: int, cmd: int, attrs: bytes) -> bytes:
    body = _GENLMSGHDR.pack(cmd, GENL_VERSION, 0) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, CREATE, seq, 0) + body


def new_service(family: int, seq: int, service: bytes) -> bytes:
    """IPVS_CMD_NEW_SERVICE with `service_attrs`, as sequence number `seq` of the IPVS family
    (its id: `family`)."""
    return _request(family, seq, IPVS_CMD_NEW_SERVICE, _nla(IPVS_CMD_ATTR_SERVICE, service))


def new_dest(family: int, seq: int, key: bytes, dest: bytes) -> bytes:
    """IPVS_CMD_NEW_DEST: a real server (`dest_attrs`) of the virtual server `service_key_attrs` names."""
    return _request(family, seq, IPVS_CMD_NEW_DEST, _nla(IPVS_CMD_ATTR_SERVICE, key) + _nla(IPVS_CMD_ATTR_DEST, dest))


# -- dumps: the kernel's answers read with struct ---------------------------------------------------
IPVS_CMD_GET_SERVICE, IPVS_CMD_GET_DEST = 4, 8
SVC_FWMARK, DEST_ACTIVE, DEST_INACTIVE = 5, 7, 8
_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER


def get_services(family: int, seq: int) -> bytes:
    """A dump request of every virtual server."""
    body = _GENLMSGHDR.pack(IPVS_CMD_GET_SERVICE, GENL_VERSION, 0)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def get_dests(family: int, seq: int, key: bytes) -> bytes:
    """A dump request of the real servers of the virtual server `service_key_attrs` names."""
    body = _GENLMSGHDR.pack(IPVS_CMD_GET_DEST, GENL_VERSION, 0) + _nla(IPVS_CMD_ATTR_SERVICE, key)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def attrs(buf: bytes, start: int = 0, end: int | None = None) -> dict[int, bytes]:
    """The attributes between `start` and `end` of `buf`, by type (flags masked off)."""
    end = len(buf) if end is None else end
    out: dict[int, bytes] = {}
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, start)
        if length < 4:
            break
        out[kind & _TYPE_MASK] = buf[start + 4:start + length]
        start += (length + 3) & ~3
    return out


def _nested(payload: bytes, kind: int) -> dict[int, bytes]:
    """The attributes nested in a dumped message's `kind` attribute (its payload: genlmsghdr first)."""
    return attrs(attrs(payload, _GENLMSGHDR.size).get(kind, b""))


def _address(af: bytes, raw: bytes) -> IPAddress | None:
    family = _U16.unpack(af)[0] if len(af) == 2 else 0
    if family == socket.AF_INET and len(raw) >= 4:
        return ipaddress.IPv4Address(raw[:4])
    if family == socket.AF_INET6 and len(raw) >= 16:
        return ipaddress.IPv6Address(raw[:16])
    return None


def _u32(a: Mapping[int, bytes], kind: int) -> int:
    raw = a.get(kind, b"")
    return _U32.unpack(raw[:4])[0] if len(raw) >= 4 else 0


def parse_service(payload: bytes) -> tuple[int, IPAddress, int, str, int, int] | None:
    """A dumped virtual server: (protocol number, address, port, scheduler, flags, timeout); None
    for one usproxy never writes (a firewall-mark service, no address)."""
    a = _nested(payload, IPVS_CMD_ATTR_SERVICE)
    address = _address(a.get(SVC_AF, b""), a.get(SVC_ADDR, b""))
    if _u32(a, SVC_FWMARK) or address is None or len(a.get(SVC_PROTOCOL, b"")) != 2 or len(a.get(SVC_PORT, b"")) != 2:
        return None
    sched = a.get(SVC_SCHED, b"").split(b"\0", 1)[0].decode(errors="replace")
    return (_U16.unpack(a[SVC_PROTOCOL])[0], address, _PORT.unpack(a[SVC_PORT])[0], sched, _u32(a, SVC_FLAGS),
            _u32(a, SVC_TIMEOUT))


def parse_dest(payload: bytes) -> tuple[IPAddress, int, int, int, int, int] | None:
    """A dumped real server: (address, port, weight, forwarding method, active, inactive connections)."""
    a = _nested(payload, IPVS_CMD_ATTR_DEST)
    address = _address(a.get(DEST_AF, b""), a.get(DEST_ADDR, b""))
    if address is None or len(a.get(DEST_PORT, b"")) != 2:
        return None
    return (address, _PORT.unpack(a[DEST_PORT])[0], _u32(a, DEST_WEIGHT), _u32(a, DEST_FWD), _u32(a, DEST_ACTIVE),
            _u32(a, DEST_INACTIVE))
