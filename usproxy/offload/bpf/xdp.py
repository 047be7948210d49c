"""XDP acceleration of NodePorts (`--bpf-lb-acceleration native`, Cilium's flag): which hooked
interfaces can run the XDP program (xdp_lb.h), and why the others cannot.

The kernel says what each interface's driver does with XDP in its xdp-features (the "netdev"
generic netlink family, NETDEV_CMD_DEV_GET, kernel 6.3+; `ip link`'s and ynl's source): BASIC is
native XDP with XDP_PASS/DROP/TX. The program sends frames back out of their interface (XDP_TX),
so an interface is usable when it has BASIC, and a veth only when its peer runs a native XDP
program of its own. A veth's XDP_TX puts the frame in the peer's ring and then wakes the peer's
NAPI only if the peer has an XDP program (drivers/net/veth.c: veth_xdp_flush_bq calls
veth_xdp_xmit without XDP_XMIT_FLUSH, and veth_xdp_flush schedules the peer's NAPI only when
`rcv_rq->xdp_prog` is set). GRO on the peer gives it a NAPI and a ring, so xdp-features shows
NDO_XMIT (a redirect target, which does flush) and XDP_TX succeeds (rx_queue_0_xdp_tx counts,
no xdp_tx_errors), yet nothing ever polls the ring: measured on this project's lab (kernel 6.18),
the peer's rx_queue_0_xdp_packets stays 0 and every XDP-served flow times out. Without NAPI at
all, veth_xdp_xmit refuses the frames (xdp_tx_errors). So a veth is usable only when the peer
(read through IFLA_LINK and IFLA_LINK_NETNSID, RTM_GETLINK with IFLA_TARGET_NETNSID, kernel 4.20+)
has a driver-mode program in its IFLA_XDP; a physical NIC's wire needs nothing of the kind.
Reading features and links attaches nothing, so the probe never disturbs an interface (on many
NICs an XDP attach resets the rings). Interfaces not usable keep the tc programs alone.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from usproxy.offload.bpf.nodeport import HookedInterface

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY, CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 3, 1, 2
NETDEV_CMD_DEV_GET, NETDEV_A_DEV_IFINDEX, NETDEV_A_DEV_XDP_FEATURES = 1, 1, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
NETLINK_ROUTE, RTM_GETLINK, RTM_NEWLINK = 0, 18, 16
IFLA_LINK, IFLA_XDP, IFLA_LINK_NETNSID, IFLA_TARGET_NETNSID = 5, 43, 37, 46
IFLA_XDP_ATTACHED, IFLA_XDP_DRV_PROG_ID = 2, 5
XDP_ATTACHED_DRV, XDP_ATTACHED_MULTI = 1, 4

XDP_ACT_BASIC = 1 << 0
XDP_ACT_NDO_XMIT = 1 << 2


@dataclass(frozen=True, slots=True)
class XdpPlan:
    """Where the XDP program runs: ifindexes, and per interface name why not (empty: everywhere)."""

    ifindexes: tuple[int, ...]
    refused: tuple[tuple[str, str], ...]  # (interface name, reason)

    def detail(self, names: Mapping[int, str]) -> str:
        """One line for the bpf capability: "XDP (native) on eth0; tc only on cbr0 (...)"."""
        parts = []
        if self.ifindexes:
            parts.append("XDP (native) on " + ", ".join(names.get(i, str(i)) for i in self.ifindexes))
        parts += [f"tc only on {name} ({why})" for name, why in self.refused]
        return "; ".join(parts)


def why_not(kind: str, features: int | None, peer_xdp: bool | None = None) -> str | None:
    """Why an interface of link kind `kind` with xdp-features `features` (None: unknown) cannot
    run the XDP program, or None when it can. `peer_xdp`, for a veth: whether its peer runs a
    native XDP program (None: unreadable); frames sent with XDP_TX reach the peer only then."""
    if features is None:
        return "xdp-features unreadable (kernel before 6.3?)"
    if not features & XDP_ACT_BASIC:
        return f"no native XDP in its driver ({kind or 'device'})"
    if kind != "veth" or peer_xdp:
        return None
    if peer_xdp is None:
        return "veth whose peer is unreadable (XDP_TX needs an XDP program on the peer)"
    if features & XDP_ACT_NDO_XMIT:
        return ("veth whose peer runs GRO but no XDP program: frames sent with XDP_TX "
                "would wait unpolled in the peer's ring")
    return "veth whose peer runs no XDP program: frames sent with XDP_TX would be dropped"


def plan(hooked: list[HookedInterface], kinds: Mapping[int, str], features: Mapping[int, int] | None,
         peers: Mapping[int, bool | None] | None = None) -> XdpPlan:
    """The XDP plan for the tc-hooked interfaces (`kinds`: ifindex -> link kind, "" for none;
    `features`: ifindex -> xdp-features, None when the kernel cannot tell; `peers`: veth ifindex ->
    whether its peer runs a native XDP program, None or absent when unreadable)."""
    ok, refused = [], []
    for h in hooked:
        why = why_not(kinds.get(h.ifindex, ""), None if features is None else features.get(h.ifindex, 0),
                      (peers or {}).get(h.ifindex))
        if why is None:
            ok.append(h.ifindex)
        else:
            refused.append((h.name, why))
    return XdpPlan(tuple(ok), tuple(refused))


def probe(hooked: list[HookedInterface]) -> XdpPlan:
    """The plan for this network namespace's interfaces (netlink reads only)."""
    try:
        features: dict[int, int] | None = xdp_features()
    except OSError:
        features = None
    kinds = link_kinds()
    return plan(hooked, kinds, features, {h.ifindex: _peer_xdp_or_none(h.ifindex)
                                          for h in hooked if kinds.get(h.ifindex) == "veth"})


def _peer_xdp_or_none(ifindex: int) -> bool | None:
    try:
        return peer_xdp(ifindex)
    except OSError:
        return None


def link_kinds() -> dict[int, str]:
    """ifindex -> IFLA_INFO_KIND ("veth", "bridge", ...; "" for a physical device)."""
    import asyncio
    import concurrent.futures

    def dump() -> dict[int, str]:
        from pyroute2 import IPRoute

        with IPRoute(use_event_loop=asyncio.SelectorEventLoop()) as ipr:
            return {int(link["index"]): str(link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") or "")
                    for link in ipr.get_links()}

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # pyroute2 runs a loop of its own
        return pool.submit(dump).result()


# -- rtnetlink: a veth's peer --------------------------------------------------------------------

def peer_xdp(ifindex: int) -> bool:
    """Whether the peer of veth `ifindex` (in this or another network namespace) runs a native
    (driver mode) XDP program. Raises OSError when either link cannot be read."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as s:
        s.settimeout(2.0)
        own = _get_link(s, ifindex, None)
        if IFLA_LINK not in own:
            raise OSError(f"ifindex {ifindex}: no peer (IFLA_LINK)")
        nsid = struct.unpack("=i", own[IFLA_LINK_NETNSID][:4])[0] if IFLA_LINK_NETNSID in own else None
        peer = _get_link(s, struct.unpack("=I", own[IFLA_LINK][:4])[0], nsid)
    xdp = _attrs(peer.get(IFLA_XDP, b""))
    attached = xdp.get(IFLA_XDP_ATTACHED, b"\0")[0]
    return attached == XDP_ATTACHED_DRV or (attached == XDP_ATTACHED_MULTI and IFLA_XDP_DRV_PROG_ID in xdp)


def _get_link(s: socket.socket, ifindex: int, nsid: int | None) -> dict[int, bytes]:
    """RTM_GETLINK for one link: its attributes (`nsid`: the namespace it lives in, as this one
    names it; None: this one)."""
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, ifindex, 0, 0)
    if nsid is not None:
        body += _attr(IFLA_TARGET_NETNSID, struct.pack("=i", nsid))
    s.send(struct.pack("=IHHII", 16 + len(body), RTM_GETLINK, NLM_F_REQUEST, 1, 0) + body)
    for mtype, msg in _messages(s.recv(65536)):
        if mtype == NLMSG_ERROR:
            err = struct.unpack("=i", msg[:4])[0]
            raise OSError(-err, f"RTM_GETLINK {ifindex}: {errno.errorcode.get(-err, err)}")
        if mtype == RTM_NEWLINK:
            return _attrs(msg[16:])
    raise OSError(f"RTM_GETLINK {ifindex}: no answer")


# -- generic netlink, "netdev" family ---------------------------------------------------------

def xdp_features() -> dict[int, int]:
    """ifindex -> xdp-features bits for every interface of this network namespace. Raises
    OSError when the kernel has no "netdev" family."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC) as s:
        s.settimeout(2.0)
        family = _family_id(s, "netdev")
        out: dict[int, int] = {}
        for attrs in _request(s, family, NETDEV_CMD_DEV_GET, NLM_F_REQUEST | NLM_F_DUMP, b""):
            if NETDEV_A_DEV_IFINDEX in attrs:
                raw = attrs.get(NETDEV_A_DEV_XDP_FEATURES, b"\0" * 8)
                out[struct.unpack("=I", attrs[NETDEV_A_DEV_IFINDEX][:4])[0]] = struct.unpack("=Q", raw[:8])[0]
        return out


def _family_id(s: socket.socket, name: str) -> int:
    attr = _attr(CTRL_ATTR_FAMILY_NAME, name.encode() + b"\0")
    for attrs in _request(s, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, NLM_F_REQUEST, attr):
        if CTRL_ATTR_FAMILY_ID in attrs:
            return int(struct.unpack("=H", attrs[CTRL_ATTR_FAMILY_ID][:2])[0])
    raise OSError(f"no generic netlink family {name}")


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _request(s: socket.socket, family: int, cmd: int, flags: int, payload: bytes) -> Iterator[dict[int, bytes]]:
    """Send one generic netlink request; the attributes of every answer (dumps included)."""
    body = struct.pack("=BBH", cmd, 1, 0) + payload
    s.send(struct.pack("=IHHII", 16 + len(body), family, flags, 1, 0) + body)
    while True:
        data = s.recv(65536)
        for mtype, msg in _messages(data):
            if mtype == NLMSG_DONE:
                return
            if mtype == NLMSG_ERROR:
                err = struct.unpack("=i", msg[:4])[0]
                if err:
                    raise OSError(-err, f"netlink: {errno.errorcode.get(-err, err)}")
                return
            yield _attrs(msg[4:])
        if not flags & NLM_F_DUMP:
            return


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + 16 <= len(data):
        length, mtype = struct.unpack("=IH", data[off:off + 6])
        yield mtype, data[off + 16:off + length]
        off += (length + 3) & ~3


def _attrs(data: bytes) -> dict[int, bytes]:
    out, off = {}, 0
    while off + 4 <= len(data):
        length, kind = struct.unpack("=HH", data[off:off + 4])
        if length < 4:
            break
        out[kind & 0x3fff] = data[off + 4:off + length]
        off += (length + 3) & ~3
    return out
