"""ctnetlink: the kernel's conntrack table over raw nfnetlink, for the stale UDP reconcile.

One dump per address family lists the UDP entries (the kernel filters the protocol with
CTA_FILTER where it can, Linux >= 5.8; older kernels send everything and the protocol is checked
here too); each entry is judged by StaleUdp while the dump is read; the stale ones are deleted
afterwards, many IPCTNL_MSG_CT_DELETE messages per send (the kernel takes a buffer of messages
one after the other, and answers only those that fail, without NLM_F_ACK), each naming the entry
by its original tuple, copied from the dump as it came, and its CTA_ID, so an entry that was
deleted and made anew by new traffic meanwhile is not deleted (ENOENT). Deleting only after the
whole dump keeps the dump's cursor on entries that still exist.

Why not pyroute2 (which usproxy used before): it decodes every attribute of every entry into
Python objects and deletes one entry per request and answer; 150,000 entries took minutes of the
agent's CPU under its GIL (issue 29 item 8). Here an entry costs a few attribute offsets, and the
whole run happens in a child process (`python -m usproxy.offload.ctnetlink`, StaleUdp as JSON on
stdin, a JSON summary on stdout): off the agent's event loop and off its GIL, on whatever CPU is
free. The child starts in the caller's network namespace (KernelConntrack forks it from its
worker thread). bench/conntrack_cleanup.py compares it with the conntrack tool.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator

from usproxy.core.stale_udp import StaleUdp

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLM_F_DUMP = 0x1, 0x4, 0x200, 0x400, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLA_F_NESTED, NLA_TYPE_MASK = 0x8000, 0x3FFF
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_TIMEOUT, CTA_ID, CTA_FILTER = 1, 2, 3, 7, 12, 25
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_FILTER_ORIG_FLAGS = 1
CTA_FILTER_F_CTA_IP_DST, CTA_FILTER_F_CTA_PROTO_NUM, CTA_FILTER_F_CTA_PROTO_DST_PORT = 1 << 1, 1 << 3, 1 << 5
FILTERED_MAX = 32  # frontends up to which each gets a dump the kernel filters for it
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
BATCH = 1 << 16  # bytes of delete messages per send (~800: the kernel runs a send without a break)
HEADER = struct.Struct("=IHHII")  # nlmsghdr
NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian, 0 here)
NLA = struct.Struct("=HH")


def attr(kind: int, payload: bytes, nested: bool = False) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    head = NLA.pack(4 + len(payload), kind | (NLA_F_NESTED if nested else 0))
    return head + payload + b"\0" * (-len(payload) % 4)


def message(kind: int, flags: int, family: int, body: bytes, seq: int = 0) -> bytes:
    """One ctnetlink message: nlmsghdr, nfgenmsg and the attributes `body`."""
    return HEADER.pack(20 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | kind, flags, seq, 0) + NFGEN.pack(family, 0, 0) + body


def tuple_attr(kind: int, family: int, src: bytes, dst: bytes, sport: int, dport: int, proto: int) -> bytes:
    """CTA_TUPLE_ORIG or CTA_TUPLE_REPLY of addresses (packed), ports and protocol."""
    s, d = (CTA_IP_V4_SRC, CTA_IP_V4_DST) if family == socket.AF_INET else (CTA_IP_V6_SRC, CTA_IP_V6_DST)
    ip = attr(CTA_TUPLE_IP, attr(s, src) + attr(d, dst), nested=True)
    ports = attr(CTA_PROTO_NUM, bytes([proto])) + attr(CTA_PROTO_SRC_PORT, struct.pack("!H", sport)) \
        + attr(CTA_PROTO_DST_PORT, struct.pack("!H", dport))
    return attr(kind, ip + attr(CTA_TUPLE_PROTO, ports, nested=True), nested=True)


def _attrs(buf: bytes, start: int, end: int) -> dict[int, tuple[int, int]]:
    """type -> (payload start, payload end) of the attributes in buf[start:end]."""
    out = {}
    while start + 4 <= end:
        length, kind = NLA.unpack_from(buf, start)
        if length < 4:
            break
        out[kind & NLA_TYPE_MASK] = (start + 4, start + length)
        start += (length + 3) & ~3
    return out


def _endpoint(buf: bytes, tup: tuple[int, int], addr_type: int, port_type: int) -> tuple[bytes, int] | None:
    """(packed address, port) of one side of a UDP tuple, or None (not UDP, or incomplete)."""
    t = _attrs(buf, *tup)
    ip, proto = t.get(CTA_TUPLE_IP), t.get(CTA_TUPLE_PROTO)
    if ip is None or proto is None:
        return None
    ips, ports = _attrs(buf, *ip), _attrs(buf, *proto)
    where = ips.get(addr_type)
    port = ports.get(port_type)
    num = ports.get(CTA_PROTO_NUM)
    if where is None or port is None or num is None or buf[num[0]] != socket.IPPROTO_UDP:
        return None
    return buf[where[0]:where[1]], struct.unpack_from("!H", buf, port[0])[0]


def _layout(alen: int) -> struct.Struct:
    """The two tuples as the kernel writes them (ctnetlink_dump_tuples: IP with source and
    destination, then protocol with number, source and destination port; no zone), for
    addresses of `alen` bytes: one unpack per entry instead of a walk over nested attributes."""
    side = f"HH HH HH{alen}s HH{alen}s HH HHB3x HHH2x HHH2x"
    return struct.Struct("=" + side + " " + side)


_LAYOUT: dict[int, struct.Struct] = {socket.AF_INET: _layout(4), socket.AF_INET6: _layout(16)}
_TYPES: dict[int, tuple[int, int]] = {socket.AF_INET: (CTA_IP_V4_SRC, CTA_IP_V4_DST), socket.AF_INET6: (CTA_IP_V6_SRC, CTA_IP_V6_DST)}


def _fixed(data: bytes, start: int, end: int, family: int) -> tuple[tuple[bytes, int], tuple[bytes, int], int] | None:
    """(original destination, reply source, end of the original tuple) when the entry has the
    usual layout of a UDP entry, else None (the caller walks the attributes instead)."""
    layout = _LAYOUT[family]
    if start + 20 + layout.size > end:
        return None
    f = layout.unpack_from(data, start + 20)
    src_t, dst_t = _TYPES[family]
    want = (CTA_TUPLE_IP, src_t, dst_t, CTA_TUPLE_PROTO, CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT)
    for kind, side in ((CTA_TUPLE_ORIG, f[:21]), (CTA_TUPLE_REPLY, f[21:])):
        types = (side[3] & NLA_TYPE_MASK, side[5], side[8], side[11] & NLA_TYPE_MASK, side[13], side[16], side[19])
        if side[0] != layout.size // 2 or side[1] & NLA_TYPE_MASK != kind or types != want or side[14] != socket.IPPROTO_UDP:
            return None
    return (f[9], socket.ntohs(f[20])), (f[27], socket.ntohs(f[38])), start + 20 + layout.size // 2


class Conntrack:
    """A ctnetlink socket pair in the caller's network namespace: one for dumps, one for
    batched changes."""

    def __init__(self) -> None:
        self.dump_sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.change_sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        for opt, fallback, size in ((SO_SNDBUFFORCE, socket.SO_SNDBUF, BATCH * 2),
                                    (SO_RCVBUFFORCE, socket.SO_RCVBUF, BATCH)):
            try:
                self.change_sock.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError:  # no CAP_NET_ADMIN: the sysctl maximum applies
                self.change_sock.setsockopt(socket.SOL_SOCKET, fallback, size)
        self.change_sock.setblocking(False)
        self.errors: dict[str, int] = {}  # errno name -> changes the kernel refused

    def close(self) -> None:
        self.dump_sock.close()
        self.change_sock.close()

    def dump_udp(self, family: int, dst: bytes | None = None, port: int | None = None) -> Iterator[tuple[bytes, int, int]]:
        """(message buffer, message start, message end) of every UDP entry of `family`, sent to
        `dst` (packed) and `port` when given (and, on a kernel that refuses the filter, of every
        entry: the caller checks the protocol and the rule the destination)."""
        flags = CTA_FILTER_F_CTA_PROTO_NUM
        fields = attr(CTA_PROTO_NUM, bytes([socket.IPPROTO_UDP]))
        if port is not None:
            flags |= CTA_FILTER_F_CTA_PROTO_DST_PORT
            fields += attr(CTA_PROTO_DST_PORT, struct.pack("!H", port))
        tup = attr(CTA_TUPLE_PROTO, fields, nested=True)
        # IPv6 addresses are not filtered in the kernel: Linux 6.18's ctnetlink_filter_match_tuple
        # tests `!ipv6_addr_cmp(...)`, which drops the entries that match and keeps the others
        # (measured: a filter for one of two frontends returned the other's entries). The port
        # filter still applies; the address is checked here.
        if dst is not None and family == socket.AF_INET:
            flags |= CTA_FILTER_F_CTA_IP_DST
            tup = attr(CTA_TUPLE_IP, attr(_TYPES[family][1], dst), nested=True) + tup
        body = attr(CTA_TUPLE_ORIG, tup, nested=True) + attr(
            CTA_FILTER, attr(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", flags)), nested=True)
        try:
            yield from self._dump(message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, family, body, seq=1))
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            yield from self._dump(message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, family, b"", seq=2))

    def _dump(self, request: bytes) -> Iterator[tuple[bytes, int, int]]:
        self.dump_sock.send(request)
        buf = bytearray(1 << 17)
        while True:
            n = self.dump_sock.recv_into(buf)
            data = bytes(buf[:n])
            off = 0
            while off + 16 <= n:
                length, kind, _, _, _ = HEADER.unpack_from(data, off)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, off + 16)[0]
                    if code:
                        raise OSError(code, f"conntrack dump: {errno.errorcode.get(code, code)}")
                    return
                yield data, off, off + length
                off += (length + 3) & ~3

    def stale_udp(self, family: int, rule: StaleUdp, dst: bytes | None = None,
                  port: int | None = None) -> tuple[int, list[bytes]]:
        """(UDP entries listed, delete messages for the stale ones), of the entries to `dst` and
        `port` when given."""
        listed, out = 0, []
        v4 = family == socket.AF_INET
        src_type, dst_type = (CTA_IP_V4_SRC, CTA_IP_V4_DST) if v4 else (CTA_IP_V6_SRC, CTA_IP_V6_DST)
        for data, start, end in self.dump_udp(family, dst, port):
            fixed = _fixed(data, start, end, family)
            if fixed is not None:
                to, frm, orig_end = fixed
                orig = (start + 24, orig_end)
            else:
                top = _attrs(data, start + 20, end)
                o, reply = top.get(CTA_TUPLE_ORIG), top.get(CTA_TUPLE_REPLY)
                d = _endpoint(data, o, dst_type, CTA_PROTO_DST_PORT) if o is not None else None
                r = _endpoint(data, reply, src_type, CTA_PROTO_SRC_PORT) if reply is not None else None
                if o is None or d is None or r is None:
                    continue  # not UDP (a kernel without CTA_FILTER sends every protocol)
                orig, to, frm = o, d, r
            if (dst is not None and to[0] != dst) or (port is not None and to[1] != port):
                continue  # a kernel without CTA_FILTER sends every entry to every dump
            listed += 1
            if rule.stale(to, frm):
                ct_id = _attrs(data, (orig[1] + 3) & ~3, end).get(CTA_ID)  # only for the stale: it sits further on
                body = data[orig[0] - 4:orig[1]] + (data[ct_id[0] - 4:ct_id[1]] if ct_id else b"")
                out.append(message(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST, family, body))
        return listed, out

    def send_batched(self, messages: list[bytes]) -> int:
        """Send `messages` many per send; returns how many the kernel did not refuse (refusals
        are counted by errno in `errors`; ENOENT: the entry ended meanwhile)."""
        refused, size = 0, 0
        batch: list[bytes] = []
        for m in messages:
            if size + len(m) > BATCH:
                refused += self._send(b"".join(batch))
                batch, size = [], 0
            batch.append(m)
            size += len(m)
        if batch:
            refused += self._send(b"".join(batch))
        return len(messages) - refused

    def _send(self, data: bytes) -> int:
        while True:
            try:
                self.change_sock.send(data)
                break
            except BlockingIOError:
                time.sleep(0.001)
        return self._drain()

    def _drain(self) -> int:
        """Read the error answers queued so far; returns how many."""
        n = 0
        buf = bytearray(1 << 16)
        while True:
            try:
                got = self.change_sock.recv_into(buf)
            except BlockingIOError:
                return n
            except OSError as err:  # ENOBUFS: answers were lost; the changes themselves were made
                name = errno.errorcode.get(err.errno or 0, "?")
                self.errors[name] = self.errors.get(name, 0) + 1
                continue
            off = 0
            while off + 20 <= got:
                length, kind, _, _, _ = HEADER.unpack_from(buf, off)
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", buf, off + 16)[0]
                    if code:
                        name = errno.errorcode.get(code, str(code))
                        self.errors[name] = self.errors.get(name, 0) + 1
                        n += 1
                off += (length + 3) & ~3


def reconcile(rule: StaleUdp) -> dict[str, object]:
    """List the UDP entries of each family `rule` needs and delete the stale ones. Returns a
    summary: entries listed, stale, deleted, refusals by errno, seconds."""
    start = time.monotonic()
    ct = Conntrack()
    listed = stale = deleted = 0
    try:
        for family, dst, port in _dumps(rule):
            n, messages = ct.stale_udp(family, rule, dst, port)
            listed, stale = listed + n, stale + len(messages)
            deleted += ct.send_batched(messages)  # the kernel handles a send before it returns
    finally:
        ct.close()
    return {"listed": listed, "stale": stale, "deleted": deleted, "errors": ct.errors,
            "seconds": round(time.monotonic() - start, 3)}


def _dumps(rule: StaleUdp) -> list[tuple[int, bytes | None, int | None]]:
    """(family, destination, port) of each dump `rule` needs: one per frontend and NodePort the
    kernel filters for, when they are few and the rule names no removed endpoint (which may
    reply to any destination); else one dump of all UDP entries per family."""
    keys = len(rule.frontends) + 2 * len(rule.node_ports)
    if rule.endpoints_gone or keys > FILTERED_MAX:
        return [(f, None, None) for f in rule.families()]
    out: list[tuple[int, bytes | None, int | None]] = [
        (socket.AF_INET6 if len(a) == 16 else socket.AF_INET, a, p) for a, p in sorted(rule.frontends)]
    out += [(f, None, p) for p in sorted(rule.node_ports) for f in (socket.AF_INET, socket.AF_INET6)]
    return out


def main(argv: list[str]) -> int:
    """`python -m usproxy.offload.ctnetlink [--nice N]`: StaleUdp as JSON on stdin, the summary
    as one JSON line on stdout (exit 1 with {"error": ...} when the kernel refuses the dump)."""
    if argv[:1] == ["--nice"]:
        os.nice(int(argv[1]))
    try:
        rule = StaleUdp.from_json(sys.stdin.read())
    except (ValueError, KeyError, TypeError) as err:
        print(json.dumps({"error": f"not a StaleUdp rule: {err}"}))
        return 2
    try:
        summary = reconcile(rule)
    except OSError as err:
        print(json.dumps({"error": f"{err.strerror or err}"}))
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
