"""Many local addresses, or local routes, for one interface in a few netlink system calls.

pyroute2 makes each request a round trip through its own event loop and message classes (~0.5 ms
of CPU each: 10,000 ClusterIPs took 5 s at start). Here the messages are packed with `struct`
(rtnetlink(7), as `ip` sends them), BATCH of them per sendmsg on one NETLINK_ROUTE socket, and the
kernel's acknowledgements (NLMSG_ERROR, one per message, by sequence number) are read back before
the next batch, so the socket's receive buffer never overflows. Runs in the netlink worker thread
(blocking calls).

- `add_addresses`: RTM_NEWADDR, host addresses (/32, /128). An address already there (EEXIST)
  counts as added.
- `add_local_routes`, `delete_local_routes`, `local_routes`: an IPv4 address made local by a
  route alone, `local ADDR dev IF table local scope host src ADDR proto PROTOCOL`: the very route
  the kernel adds for an address, without the address. The kernel delivers, binds, answers ARP
  and picks the source of a node's own connection by that route exactly as for an address, but
  adding one costs it O(log n), where an address costs O(n) on an interface that holds n of them
  (10,000: 0.09 s of system time against 1.2 s; docs/platform.md). PROTOCOL marks the routes as
  usproxy's, so an agent finds its own again after a restart. A route already there (EEXIST: the
  same route, or the route of an address) counts as added, a route already gone (ESRCH) as
  deleted.
Any other refusal raises OSError with the kernel's errno and the address.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address

from usproxy.model.types import IPAddress

RTM_NEWADDR, RTM_DELADDR, RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 20, 21, 24, 25, 26
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLM_F_DUMP = 0x1, 0x4, 0x200, 0x400, 0x300
RTM_F_FIB_MATCH = 0x2000  # RTM_GETROUTE: answer with the FIB entry that matched (Linux >= 4.13)
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_PREFSRC, RTA_TABLE = 1, 4, 7, 15
RT_TABLE_LOCAL, RT_SCOPE_HOST, RTN_LOCAL = 255, 254, 2
RTPROT_USPROXY = 117  # "u": the routes usproxy adds (rtnetlink(7) leaves 5-254 free but for named daemons')
BATCH = 128  # messages per sendmsg: their acknowledgements (~1 KiB each as the kernel counts them) fit the default receive buffer

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RTATTR = struct.Struct("=HH")  # len, type
_U32 = struct.Struct("=I")


def _message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body


def _attr(kind: int, value: bytes) -> bytes:
    return _RTATTR.pack(_RTATTR.size + len(value), kind) + value  # 4- and 16-byte values: aligned


def newaddr(seq: int, index: int, ip: IPAddress, flags: int, kind: int = RTM_NEWADDR) -> bytes:
    """One RTM_NEWADDR (or RTM_DELADDR) request: `ip` as a host address (/32, /128) on
    interface `index`."""
    packed = ip.packed
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    body = (_IFADDRMSG.pack(family, len(packed) * 8, flags, 0, index)
            + _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed))
    create = NLM_F_CREATE | NLM_F_EXCL if kind == RTM_NEWADDR else 0
    return _message(kind, NLM_F_REQUEST | NLM_F_ACK | create, seq, body)


def local_route(kind: int, seq: int, index: int, ip: IPv4Address) -> bytes:
    """One RTM_NEWROUTE or RTM_DELROUTE request for `ip`'s local route via interface `index`."""
    packed = ip.packed
    body = (_RTMSG.pack(socket.AF_INET, 32, 0, 0, RT_TABLE_LOCAL, RTPROT_USPROXY, RT_SCOPE_HOST, RTN_LOCAL, 0)
            + _attr(RTA_DST, packed) + _attr(RTA_PREFSRC, packed) + _attr(RTA_OIF, _U32.pack(index)))
    flags = NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE | NLM_F_EXCL if kind == RTM_NEWROUTE else 0)
    return _message(kind, flags, seq, body)


def add_addresses(index: int, ips: Sequence[IPAddress], flags: int) -> None:
    """Add `ips` to interface `index` with ifaddrmsg `flags` (IFA_F_NODAD). Raises OSError."""
    _send([newaddr(n + 1, index, ip, flags) for n, ip in enumerate(ips)], ips, "adding", (errno.EEXIST,))


def routes_for_addresses(index: int, ips: Sequence[IPv4Address], kept: Sequence[IPv4Address]) -> None:
    """Turn the IPv4 addresses `ips` on interface `index` into local routes, in two batches of
    messages: first the addresses go, then the routes come, for them and for `kept` (routes via
    `index` already there). When an interface loses its last IPv4 address, the kernel flushes every
    route via it, so no address may go once routes are there. Raises OSError."""
    _send([newaddr(n + 1, index, ip, 0, RTM_DELADDR) for n, ip in enumerate(ips)], ips, "removing",
          (errno.EADDRNOTAVAIL,))
    add_local_routes(index, sorted({*ips, *kept}))


def add_local_routes(index: int, ips: Sequence[IPv4Address]) -> None:
    """Make each of `ips` local by its route via interface `index`. Raises OSError."""
    _send([local_route(RTM_NEWROUTE, n + 1, index, ip) for n, ip in enumerate(ips)], ips, "adding", (errno.EEXIST,))


def delete_local_routes(index: int, ips: Sequence[IPv4Address]) -> None:
    """Remove the local routes `add_local_routes` added. Raises OSError."""
    _send([local_route(RTM_DELROUTE, n + 1, index, ip) for n, ip in enumerate(ips)], ips, "removing",
          (errno.ESRCH, errno.ENOENT))


def _send(messages: Sequence[bytes], ips: Sequence[IPAddress], doing: str, fine: Iterable[int]) -> None:
    """Send `messages` (sequence numbers 1..n, the n-th about ips[n - 1]) BATCH per system call;
    raises OSError for the first refusal whose errno is not in `fine`."""
    ok = {0, *(-code for code in fine)}
    failure: OSError | None = None
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        for at in range(0, len(messages), BATCH):
            sock.sendall(b"".join(messages[at:at + BATCH]))
            for seq, code in _acknowledged(sock, set(range(at + 1, min(at + BATCH, len(messages)) + 1))):
                if code not in ok and failure is None:
                    failure = OSError(-code, f"{doing} {ips[seq - 1]}: {os.strerror(-code)}")
    if failure is not None:
        raise failure


def _acknowledged(sock: socket.socket, pending: set[int]) -> list[tuple[int, int]]:
    """(sequence number, error code) of each acknowledgement, until every one in `pending` came."""
    out = []
    while pending:
        data = sock.recv(1 << 16)
        at = 0
        while at + _NLMSGHDR.size <= len(data):
            length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data, at)
            if length < _NLMSGHDR.size:
                raise OSError(errno.EPROTO, "netlink: malformed acknowledgement")
            if kind == NLMSG_ERROR and seq in pending:
                pending.discard(seq)
                out.append((seq, struct.unpack_from("=i", data, at + _NLMSGHDR.size)[0]))
            at += (length + 3) & ~3
    return out


def is_routed(index: int, ip: IPv4Address) -> bool:
    """Whether the kernel resolves `ip` by usproxy's local route via interface `index` (one
    RTM_GETROUTE for the FIB entry that matches). Raises OSError but for ENETUNREACH."""
    request = (_RTMSG.pack(socket.AF_INET, 32, 0, 0, 0, 0, 0, 0, RTM_F_FIB_MATCH) + _attr(RTA_DST, ip.packed))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(_message(RTM_GETROUTE, NLM_F_REQUEST, 1, request))
        data = sock.recv(1 << 16)
    length, kind, _, _, _ = _NLMSGHDR.unpack_from(data)
    body = _NLMSGHDR.size
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, body)[0]
        if code in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return False
        raise OSError(code, f"netlink route lookup of {ip}: {os.strerror(code)}")
    found: set[IPv4Address] = set()
    _match(data, 0, length, index, found, any_table=True)  # the main table's id while local is merged into it
    return ip in found


def local_routes(index: int) -> set[IPv4Address]:
    """The addresses usproxy's local routes (RTPROT_USPROXY, table local) make local via interface
    `index`: one dump of the IPv4 routes, parsed with struct. Raises OSError."""
    out: set[IPv4Address] = set()
    request = _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_LOCAL, 0, 0, 0, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(_message(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, 1, request))
        while True:
            data = sock.recv(1 << 20)
            if _parse_routes(data, index, out):
                return out


def _parse_routes(data: bytes, index: int, out: set[IPv4Address]) -> bool:
    """Add the matching routes of one reply buffer to `out`; True at the end of the dump."""
    at = 0
    while at + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, at)
        if kind == NLMSG_DONE:
            return True
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", data, at + _NLMSGHDR.size)[0]
            raise OSError(code, f"netlink route dump: {os.strerror(code)}")
        if kind == RTM_NEWROUTE:
            _match(data, at, length, index, out)
        at += (max(length, _NLMSGHDR.size) + 3) & ~3
    return False


def _match(data: bytes, at: int, length: int, index: int, out: set[IPv4Address], any_table: bool = False) -> None:
    """Add the destination of the RTM_NEWROUTE message at `at` to `out` when it is usproxy's
    local route via interface `index` in table local (in any table: `any_table`)."""
    body = at + _NLMSGHDR.size
    if length < _NLMSGHDR.size + _RTMSG.size:
        return
    _, dst_len, _, _, table, protocol, _, rtype, _ = _RTMSG.unpack_from(data, body)
    if protocol != RTPROT_USPROXY or rtype != RTN_LOCAL or dst_len != 32:
        return
    attrs = _attributes(data, body + _RTMSG.size, at + length)
    oif = _U32.unpack(attrs.get(RTA_OIF, b"\0\0\0\0"))[0]
    full_table = _U32.unpack(attrs.get(RTA_TABLE, _U32.pack(table)))[0]
    if oif == index and (any_table or full_table == RT_TABLE_LOCAL) and len(attrs.get(RTA_DST, b"")) == 4:
        out.add(IPv4Address(attrs[RTA_DST]))


def _attributes(data: bytes, start: int, end: int) -> dict[int, bytes]:
    found: dict[int, bytes] = {}
    while start + _RTATTR.size <= end:
        alen, atype = _RTATTR.unpack_from(data, start)
        found[atype] = data[start + _RTATTR.size:start + alen]
        start += (max(alen, _RTATTR.size) + 3) & ~3
    return found
