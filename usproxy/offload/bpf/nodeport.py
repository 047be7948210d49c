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

usp_dsr_peers holds the node networks, where the other nodes of the cluster have the NodePort
addresses a DSR option may name (dsr.h): the IPv4 CIDRs of --nodeport-addresses (kube-proxy's
"ranges of valid node IPs"; every node of a cluster is given the same) and the networks of this
node's own NodePort addresses (the subnets its interfaces hold them in: a cluster on one network
needs no flag). A cluster whose nodes are on other networks than this node's passes them in
--nodeport-addresses for DSR to accept their options.
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
from usproxy.offload.bpf.layout import CT_DSR, CT_MAPS, CT_PENDING, CtEntry, pack_peer_net, pack_u32
from usproxy.model.types import format_hostport
from usproxy.util.rows import FlowRow

VIP_INTERFACE = "usproxy0"  # the relay's VipInterface default name


@dataclass(frozen=True, slots=True, order=True)
class HookedInterface:
    """One interface the tc programs run on: its index, name, the node addresses it holds and
    their networks (the subnets the interface holds them in)."""

    ifindex: int
    name: str
    addresses: tuple[ipaddress.IPv4Address, ...]
    networks: tuple[ipaddress.IPv4Network, ...] = ()


def choose(links: Mapping[int, str], addresses: Iterable[tuple[int, ipaddress.IPv4Address]],
           cidrs: tuple[IPNetwork, ...]) -> list[HookedInterface]:
    """The interfaces to hook, from (ifindex -> name) and (ifindex, address) pairs (an
    IPv4Interface gives its network too); see the module docstring for the rule."""
    chosen: dict[int, list[ipaddress.IPv4Address]] = {}
    nets: dict[int, list[ipaddress.IPv4Network]] = {}
    for ifindex, addr in addresses:
        ip = ipaddress.IPv4Address(int(addr))
        if ip.is_link_local or links.get(ifindex) in (None, VIP_INTERFACE):
            continue
        if cidrs and not any(ip in n for n in cidrs):
            continue
        if not cidrs and ip.is_loopback:
            continue
        chosen.setdefault(ifindex, []).append(ip)
        net = addr.network if isinstance(addr, ipaddress.IPv4Interface) else ipaddress.IPv4Network(ip)
        if net not in nets.setdefault(ifindex, []):
            nets[ifindex].append(net)
    return [HookedInterface(i, links[i], tuple(ips), tuple(nets[i])) for i, ips in sorted(chosen.items())]


def interfaces(cidrs: tuple[IPNetwork, ...]) -> list[HookedInterface]:
    """The interfaces of this network namespace to hook (netlink via pyroute2, in a thread of
    its own: pyroute2 runs an event loop, which cannot nest in the agent's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        links, addrs = pool.submit(_dump).result()
    return choose(links, addrs, cidrs)


def _dump() -> tuple[dict[int, str], list[tuple[int, ipaddress.IPv4Address]]]:
    """Links by index, and every IPv4 address with its network (an IPv4Interface)."""
    from pyroute2 import IPRoute

    with IPRoute(use_event_loop=asyncio.SelectorEventLoop()) as ipr:
        links = {int(link["index"]): str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()}
        addrs: list[tuple[int, ipaddress.IPv4Address]] = [
            (int(a["index"]), ipaddress.IPv4Interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"))
            for a in ipr.get_addr(family=socket.AF_INET)]
    return links, addrs


def follow(hooked: list[HookedInterface], now: list[HookedInterface]) -> list[HookedInterface]:
    """`hooked` (the interfaces the tc programs run on) with the addresses `now` (interfaces()
    read again) gives them: none for an interface that lost its NodePort addresses or is gone."""
    current = {h.ifindex: h for h in now}
    return [HookedInterface(h.ifindex, h.name, current[h.ifindex].addresses if h.ifindex in current else (),
                            current[h.ifindex].networks if h.ifindex in current else ()) for h in hooked]


def unhooked(hooked: list[HookedInterface], now: list[HookedInterface]) -> list[HookedInterface]:
    """The interfaces of `now` that hold NodePort addresses but run no tc program."""
    have = {h.ifindex for h in hooked}
    return [h for h in now if h.ifindex not in have]


def write_maps(fds: Mapping[str, int], hooked: list[HookedInterface], cidrs: tuple[IPNetwork, ...] = ()) -> None:
    """Make usp_tc_addrs and usp_tc_ifaces hold exactly `hooked`, and usp_dsr_peers the node
    networks (`cidrs`, --nodeport-addresses, and the hooked addresses' networks: dsr_peers); new
    entries before stale ones go, so a restart never leaves a moment without them. An interface
    without addresses has no usp_tc_ifaces entry (the tc program passes its packets)."""
    addrs = {ip.packed: pack_u32(h.ifindex) for h in hooked for ip in h.addresses}
    ifaces = {pack_u32(h.ifindex): h.addresses[0].packed for h in hooked if h.addresses}
    _sync(fds["usp_tc_addrs"], addrs, 4)
    _sync(fds["usp_tc_ifaces"], ifaces, 4)
    if "usp_dsr_peers" in fds:
        _sync(fds["usp_dsr_peers"], {pack_peer_net(n): pack_u32(1) for n in dsr_peers(hooked, cidrs)}, 8)


def dsr_peers(hooked: list[HookedInterface], cidrs: tuple[IPNetwork, ...]) -> list[ipaddress.IPv4Network]:
    """The node networks a DSR option's NodePort address must be in (module docstring)."""
    nets = [n for n in cidrs if isinstance(n, ipaddress.IPv4Network)]
    nets += [n for h in hooked for n in h.networks]
    return sorted(set(nets), key=lambda n: (int(n.network_address), n.prefixlen))


def _sync(fd: int, want: dict[bytes, bytes], key_size: int) -> None:
    for key, value in want.items():
        bpf.map_update(fd, key, value)
    for key in list(bpf.map_keys(fd, key_size)):
        if key not in want:
            bpf.map_delete(fd, key)


def ct_entries(fds: Mapping[str, int], limit: int = 10000) -> list[CtEntry]:
    """The entries (both directions) of the conntrack tables in `fds` (by map name; a table an
    older agent's pins lack is skipped): confirmed ones first, at most `limit`."""
    out: list[CtEntry] = []
    for name, size in CT_MAPS.items():
        if name not in fds or len(out) >= limit:
            continue
        items = bpf.map_items(fds[name], CtEntry.KEY_SIZE, size)[:limit - len(out)]
        out += [CtEntry.unpack(k, v, confirmed=name != CT_PENDING) for k, v in items]
    return out


def ct_row(e: CtEntry, service: str, now: int) -> FlowRow:
    """One ORIGINAL entry as a /flows row (usproxy/util/rows.py): a flow the tc
    program NATs. The reply's destination is the SNAT address, or the client's own without SNAT;
    state DSR: the reply goes from the backend's node straight to the client (dsr.h); NEW: the
    flow is not confirmed yet (no reply and acknowledgment of it seen: sock_lb.c)."""
    reply_dst = (e.nat_saddr, e.nat_sport) if int(e.nat_saddr) else (e.saddr, e.sport)
    return {
        "protocol": "TCP" if e.proto == socket.IPPROTO_TCP else "UDP",
        "state": "DSR" if e.flags & CT_DSR else "NAT" if e.confirmed else "NEW",
        "age": max(0, now - e.created) / 1e9, "idle": max(0, now - e.last) / 1e9,
        "original": {"src": format_hostport(e.saddr, e.sport), "dst": format_hostport(e.daddr, e.dport)},
        "reply": {"src": format_hostport(e.nat_daddr, e.nat_dport), "dst": format_hostport(*reply_dst)},
        "packets_in": e.packets, "bytes_in": 0, "packets_out": 0, "bytes_out": 0,
        "datapath": "bpf-tc", "service": service,
    }
