"""NodePort at tc: which interfaces the tc programs hook, and the maps that tell them so.

The interfaces are chosen as kube-proxy's --nodeport-addresses chooses addresses
(pkg/proxy/util/nodeport_addresses.go): an interface is hooked when it holds an IPv4 address
inside one of the CIDRs, or, without CIDRs, any IPv4 address but loopback; link-local addresses
never count, and the relay's VIP interface (it holds Service addresses, not node addresses) is
skipped. usp_tc_addrs gets every chosen address (the destinations that serve NodePorts),
usp_tc_ifaces each hooked interface with its first chosen address (the SNAT source for backends
reached through it). Interfaces are chosen when the datapath opens; their addresses are followed
afterwards (`follow`, when the agent sees the NodePort addresses change): an address added to or
removed from a hooked interface enters or leaves both maps. An interface that holds a NodePort
address only later gets no tc program until the agent restarts: its NodePorts are served by
nftables or the relay meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from usproxy.model.types import IPNetwork
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.layout import CT_DSR, CtEntry, pack_u32
from usproxy.model.types import format_hostport
from usproxy.util.rows import FlowRow

VIP_INTERFACE = "usproxy0"  # the relay's VipInterface default name


@dataclass(frozen=True, slots=True, order=True)
class HookedInterface:
    """One interface the tc programs run on: its index, name and the node addresses it holds."""

    ifindex: int
    name: str
    addresses: tuple[ipaddress.IPv4Address, ...]


def choose(links: Mapping[int, str], addresses: Iterable[tuple[int, ipaddress.IPv4Address]],
           cidrs: tuple[IPNetwork, ...]) -> list[HookedInterface]:
    """The interfaces to hook, from (ifindex -> name) and (ifindex, address) pairs; see the module
    docstring for the rule."""
    chosen: dict[int, list[ipaddress.IPv4Address]] = {}
    for ifindex, ip in addresses:
        if ip.is_link_local or links.get(ifindex) in (None, VIP_INTERFACE):
            continue
        if cidrs and not any(ip in n for n in cidrs):
            continue
        if not cidrs and ip.is_loopback:
            continue
        chosen.setdefault(ifindex, []).append(ip)
    return [HookedInterface(i, links[i], tuple(ips)) for i, ips in sorted(chosen.items())]


def interfaces(cidrs: tuple[IPNetwork, ...]) -> list[HookedInterface]:
    """The interfaces of this network namespace to hook (netlink via pyroute2, in a thread of
    its own: pyroute2 runs an event loop, which cannot nest in the agent's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        links, addrs = pool.submit(_dump).result()
    return choose(links, addrs, cidrs)


def _dump() -> tuple[dict[int, str], list[tuple[int, ipaddress.IPv4Address]]]:
    from pyroute2 import IPRoute

    with IPRoute(use_event_loop=asyncio.SelectorEventLoop()) as ipr:
        links = {int(link["index"]): str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()}
        addrs = [(int(a["index"]), ipaddress.IPv4Address(a.get_attr("IFA_ADDRESS")))
                 for a in ipr.get_addr(family=socket.AF_INET)]
    return links, addrs


def follow(hooked: list[HookedInterface], now: list[HookedInterface]) -> list[HookedInterface]:
    """`hooked` (the interfaces the tc programs run on) with the addresses `now` (interfaces()
    read again) gives them: none for an interface that lost its NodePort addresses or is gone."""
    current = {h.ifindex: h.addresses for h in now}
    return [HookedInterface(h.ifindex, h.name, current.get(h.ifindex, ())) for h in hooked]


def unhooked(hooked: list[HookedInterface], now: list[HookedInterface]) -> list[HookedInterface]:
    """The interfaces of `now` that hold NodePort addresses but run no tc program."""
    have = {h.ifindex for h in hooked}
    return [h for h in now if h.ifindex not in have]


def write_maps(fds: Mapping[str, int], hooked: list[HookedInterface]) -> None:
    """Make usp_tc_addrs and usp_tc_ifaces hold exactly `hooked` (new entries before stale ones
    go, so a restart never leaves a moment without them); an interface without addresses has no
    usp_tc_ifaces entry (the tc program passes its packets)."""
    addrs = {ip.packed: pack_u32(h.ifindex) for h in hooked for ip in h.addresses}
    ifaces = {pack_u32(h.ifindex): h.addresses[0].packed for h in hooked if h.addresses}
    _sync(fds["usp_tc_addrs"], addrs)
    _sync(fds["usp_tc_ifaces"], ifaces)


def _sync(fd: int, want: dict[bytes, bytes]) -> None:
    for key, value in want.items():
        bpf.map_update(fd, key, value)
    for key in list(bpf.map_keys(fd, 4)):
        if key not in want:
            bpf.map_delete(fd, key)


def ct_entries(fd: int, limit: int = 10000) -> list[CtEntry]:
    """usp_ct's entries (both directions), at most `limit`."""
    items = bpf.map_items(fd, CtEntry.KEY_SIZE, CtEntry.VAL_SIZE)[:limit]
    return [CtEntry.unpack(k, v) for k, v in items]


def ct_row(e: CtEntry, service: str, now: int) -> FlowRow:
    """One ORIGINAL entry as a /flows row (usproxy/util/rows.py): a flow the tc
    program NATs. The reply's destination is the SNAT address, or the client's own without SNAT;
    state DSR: the reply goes from the backend's node straight to the client (dsr.h)."""
    reply_dst = (e.nat_saddr, e.nat_sport) if int(e.nat_saddr) else (e.saddr, e.sport)
    return {
        "protocol": "TCP" if e.proto == socket.IPPROTO_TCP else "UDP",
        "state": "DSR" if e.flags & CT_DSR else "NAT",
        "age": max(0, now - e.created) / 1e9, "idle": max(0, now - e.last) / 1e9,
        "original": {"src": format_hostport(e.saddr, e.sport), "dst": format_hostport(e.daddr, e.dport)},
        "reply": {"src": format_hostport(e.nat_daddr, e.nat_dport), "dst": format_hostport(*reply_dst)},
        "packets_in": e.packets, "bytes_in": 0, "packets_out": 0, "bytes_out": 0,
        "datapath": "bpf-tc", "service": service,
    }
