"""Netlink without pyroute2: `requests` sends any family's messages many to a system call,
`add_addresses` host addresses on one interface, `dump` reads one dump's messages.

pyroute2 makes each request a round trip through its own event loop and message classes (~0.5 ms
of CPU each: 10,000 ClusterIPs took 5 s at start, and IPVS's 10,000 virtual servers with 20,000
real servers ten times a relay's share). Here the messages are packed BATCH to a sendmsg on one
socket of the family, each asking for its acknowledgement, and the acknowledgements (NLMSG_ERROR,
one per message, by sequence number) are read back before the next batch, so the socket's receive
buffer never overflows. The kernel runs the messages of one sendmsg one after the other, each
whatever the others' outcome (netlink(7)); `requests` returns each message's errno (0: done), in
order. Blocking calls, run in a worker thread: the socket opens in that thread's network
namespace.

Addresses are packed with `struct` (rtnetlink(7): nlmsghdr, ifaddrmsg, rtattr IFA_LOCAL and
IFA_ADDRESS, as `ip address add` and pyroute2 send them); an address already there (EEXIST)
counts as added, any other refusal raises OSError with the kernel's errno and the address.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Sequence
from functools import partial

NETLINK_GENERIC = 16  # not in Python's socket module
RTM_NEWADDR = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLM_F_DUMP = 0x1, 0x4, 0x200, 0x400, 0x300
IFA_ADDRESS, IFA_LOCAL = 1, 2
BATCH = 128  # messages per sendmsg: their acknowledgements (~1 KiB each as the kernel counts them) fit the default receive buffer

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTATTR = struct.Struct("=HH")  # len, type

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Request = Callable[[int], bytes]  # the message, given its sequence number


def requests(protocol: int, messages: Sequence[Request]) -> list[int]:
    """Send `messages` on a new socket of netlink `protocol`, BATCH per sendmsg; each one's errno
    (0 when the kernel did it), in order."""
    codes: list[int] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol) as sock:
        sock.bind((0, 0))
        for at in range(0, len(messages), BATCH):
            batch = messages[at:at + BATCH]
            sock.sendall(b"".join(build(at + n + 1) for n, build in enumerate(batch)))
            codes += _acknowledged(sock, range(at + 1, at + len(batch) + 1))
    return codes


def _acknowledged(sock: socket.socket, seqs: range) -> list[int]:
    """Read acknowledgements until every sequence number in `seqs` has one; their errnos in order."""
    got: dict[int, int] = {}
    while len(got) < len(seqs):
        data = sock.recv(1 << 16)
        at = 0
        while at + _NLMSGHDR.size <= len(data):
            length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data, at)
            if length < _NLMSGHDR.size:
                raise OSError(errno.EPROTO, "netlink: malformed acknowledgement")
            if kind == NLMSG_ERROR and seq in seqs:
                got[seq] = -struct.unpack_from("=i", data, at + _NLMSGHDR.size)[0]
            at += (length + 3) & ~3
    return [got[s] for s in seqs]


def newaddr(seq: int, *, index: int, ip: Address, flags: int) -> bytes:
    """One RTM_NEWADDR request: `ip` as a host address (/32, /128) on interface `index`."""
    packed = ip.packed
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    attr = _RTATTR.size + len(packed)  # 8 or 20: both already 4-byte aligned
    body = (_IFADDRMSG.pack(family, len(packed) * 8, flags, 0, index)
            + _RTATTR.pack(attr, IFA_LOCAL) + packed + _RTATTR.pack(attr, IFA_ADDRESS) + packed)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_NEWADDR,
                          NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, seq, 0) + body


def add_addresses(index: int, ips: Sequence[Address], flags: int) -> None:
    """Add `ips` to interface `index` with ifaddrmsg `flags` (IFA_F_NODAD). Raises OSError for
    the first address refused other than with EEXIST."""
    codes = requests(socket.NETLINK_ROUTE, [partial(newaddr, index=index, ip=ip, flags=flags) for ip in ips])
    for ip, code in zip(ips, codes):
        if code not in (0, errno.EEXIST):
            raise OSError(code, f"adding {ip}: {os.strerror(code)}")


def dump(sock: socket.socket, request: bytes) -> list[bytes]:
    """Send one dump `request` on `sock` (bound); the payload after the nlmsghdr of every message
    the kernel answers with, until NLMSG_DONE. Raises OSError with the kernel's errno."""
    sock.sendall(request)
    out: list[bytes] = []
    while True:
        data = sock.recv(1 << 17)
        at = 0
        while at + _NLMSGHDR.size <= len(data):
            length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, at)
            if length < _NLMSGHDR.size:
                raise OSError(errno.EPROTO, "netlink: malformed dump message")
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, at + _NLMSGHDR.size)[0]
                if code:
                    raise OSError(code, f"netlink dump: {os.strerror(code)}")
            else:
                out.append(data[at + _NLMSGHDR.size:at + length])
            at += (length + 3) & ~3
