"""XDP acceleration of NodePorts (`--bpf-lb-acceleration native`, Cilium's flag): which hooked
interfaces can run the XDP program (xdp_lb.h), and why the others cannot.

The kernel says what each interface's driver does with XDP in its xdp-features (the "netdev"
generic netlink family, NETDEV_CMD_DEV_GET, kernel 6.3+; `ip link`'s and ynl's source): BASIC is
native XDP with XDP_PASS/DROP/TX. The program sends frames back out of their interface (XDP_TX),
so an interface is usable when it has BASIC; a veth also needs NDO_XMIT, which the kernel sets on
a veth only while its peer runs NAPI (an XDP program or GRO on the peer): without it veth drops
every frame sent with XDP_TX (drivers/net/veth.c, veth_xdp_xmit and veth_set_xdp_features). Found
on this project's lab (kernel 6.18): with only GRO on the peer, XDP_TX frames after the first were
lost; an XDP program on the peer works. And a veth hands XDP the sender's partial checksum when the
sender is a local socket with checksum offload (no wire does): XDP's incremental update cannot
complete it, so lab senders need tx checksum offload off (tests/cluster/cluster.py uplink_napi).
Reading the features attaches nothing, so the probe never disturbs an interface (on many NICs an
XDP attach resets the rings). Interfaces not usable keep the tc programs alone.
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

XDP_ACT_BASIC = 1 << 0
XDP_ACT_NDO_XMIT = 1 << 2

Acceleration = str  # "native" | "disabled"
ACCELERATIONS = ("native", "disabled")


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


def why_not(kind: str, features: int | None) -> str | None:
    """Why an interface of link kind `kind` with xdp-features `features` (None: unknown) cannot
    run the XDP program, or None when it can."""
    if features is None:
        return "xdp-features unreadable (kernel before 6.3?)"
    if not features & XDP_ACT_BASIC:
        return f"no native XDP in its driver ({kind or 'device'})"
    if kind == "veth" and not features & XDP_ACT_NDO_XMIT:
        return "veth whose peer runs no NAPI (an XDP program or GRO on the peer)"
    return None


def plan(hooked: list[HookedInterface], kinds: Mapping[int, str], features: Mapping[int, int] | None) -> XdpPlan:
    """The XDP plan for the tc-hooked interfaces (`kinds`: ifindex -> link kind, "" for none;
    `features`: ifindex -> xdp-features, None when the kernel cannot tell)."""
    ok, refused = [], []
    for h in hooked:
        why = why_not(kinds.get(h.ifindex, ""), None if features is None else features.get(h.ifindex, 0))
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
    return plan(hooked, link_kinds(), features)


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
