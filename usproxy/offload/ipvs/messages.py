"""IPVS generic netlink requests packed with `struct`: a new virtual server, a new real server.

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
"""

from __future__ import annotations

import socket
import struct

from usproxy.model.types import IPAddress
from usproxy.util.netlink_batch import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST

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
