"""NodeFacts: this node's identity, resolved once at start and handed to every part.

The Proxier (which endpoints are local), the relay and the nftables datapath (which addresses
serve NodePorts, which endpoints may hairpin) must agree on the node; so the agent resolves it
once, before anything is built, and passes the same frozen value to each. Nothing changes it
later: what does change while running (the topology zone, whether the Node is being deleted, the
addresses interfaces hold) is not a fact of this value. NodeFacts.nodeport_ips() is the one rule
by which every datapath picks the NodePort addresses from the local addresses it reads.

--nodeport-addresses as kube-proxy (pkg/proxy/util/nodeport_addresses.go, cmd/kube-proxy/app
server.go): CIDRs apply per IP family (a family none of them names serves NodePorts on every
local address), and "primary" means the node's primary address of each family. kube-proxy
takes those from the Node object; usproxy, which must know them before any source lists, takes
the address each family's default route leaves from (the node IP on a usual node). usproxy's
default stays every local address, as kube-proxy's iptables and IPVS modes and usproxy's relay
always did; kube-proxy's nftables mode defaults to "primary" (pass it to get that).

detectLocalMode NodeCIDR as kube-proxy (cmd/kube-proxy/app/server_linux.go platformSetup,
waitForPodCIDR, getLocalDetectors): the detector is this Node's spec.podCIDRs, the first of each
IP family, read once before anything is built (the agent waits for them: app/agent.node_facts)
and kept in `NodeFacts.pod_cidrs`; a later change is the source's to notice (kube-proxy exits to
be restarted, pkg/proxy/node.go), never a change of this value.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from usproxy.model.config import ProxyConfig, parse_nodeport_addresses
from usproxy.model.types import IPNetwork
from usproxy.util.errors import ConfigError, SourceError
from usproxy.model.fields import is_dns1123_subdomain
from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.types import IPAddress, parse_cidr_sloppy

log = logging.getLogger(__name__)
T = TypeVar("T")
LocalAddresses = list[tuple[str, IPAddress]]  # (interface name, address)



# The IPVS datapath's dummy device (kube-proxy's IPVS mode's name): it holds Service addresses, which
# are never NodePort addresses (kube-proxy's IPVS NodeIPs leaves its addresses out alike)
IPVS_DEVICE = "kube-ipvs0"

@dataclass(frozen=True, slots=True)
class NodeFacts:
    """This node as every part of the agent sees it.

    `name` is the Node's name (EndpointSlice endpoints with this nodeName are local), or None when
    it is unknown (a static source without --hostname-override or NODE_NAME): then no endpoint is
    known to be local. `nodeport_cidrs` restricts the addresses that serve NodePorts
    (--nodeport-addresses, "primary" resolved to /32 and /128 networks), per IP family: a family
    with no CIDR serves NodePorts on every local address but loopback.
    `detector` tells pod traffic from the rest and `masquerade_all` masquerades every ClusterIP
    connection (kube-proxy's detectLocalMode and masqueradeAll: both decide what the kernel
    datapaths masquerade). `pod_cidrs` is the Node's spec.podCIDRs the NodeCIDR detector was
    built from (None: detectLocalMode is not NodeCIDR).
    """

    name: str | None = None
    nodeport_cidrs: tuple[IPNetwork, ...] = ()
    detector: LocalDetector = LocalDetector()
    masquerade_all: bool = False
    pod_cidrs: tuple[IPNetwork, ...] | None = None

    def nodeport_match_all(self, version: int) -> bool:
        """Whether every local address of IP `version` (4, 6) serves NodePorts: no CIDR of that
        family, or a zero one (kube-proxy NodePortAddresses.MatchAll)."""
        mine = [n for n in self.nodeport_cidrs if n.version == version]
        return not mine or any(n.prefixlen == 0 for n in mine)

    def nodeport_ips(self, local: Iterable[tuple[str, IPAddress]], clusterip_interface: str) -> tuple[IPAddress, ...]:
        """The addresses among `local` ((interface, address) pairs) that serve NodePorts, sorted:
        admitted by nodeport_cidrs (per family), never loopback (kube-proxy's nftables mode
        refuses localhost NodePorts), link-local, nor on the ClusterIP interface or IPVS_DEVICE
        (Service addresses both, never the node's)."""
        out = set()
        for ifname, ip in local:
            if ifname in (clusterip_interface, IPVS_DEVICE) or ip.is_loopback or ip.is_link_local:
                continue
            if self.nodeport_match_all(ip.version) or any(ip in n for n in self.nodeport_cidrs):
                out.add(ip)
        return tuple(sorted(out, key=lambda a: (a.version, int(a))))


def node_name(cfg: ProxyConfig, *, kubernetes: bool, environ: Mapping[str, str] = os.environ,
              hostname: Callable[[], str] = socket.gethostname) -> tuple[str | None, str]:
    """(this node's name, where it came from): --hostname-override, else $NODE_NAME (the DaemonSet
    sets it from spec.nodeName), else, with a Kubernetes source, the lower-cased hostname (as
    kube-proxy, cmd/kube-proxy/app/server.go via utilnode.GetHostname); a static source without
    either has no name (None)."""
    name = cfg.hostname_override or environ.get("NODE_NAME") or None
    origin = "--hostname-override" if cfg.hostname_override else "NODE_NAME"
    if name is None and kubernetes:
        name, origin = hostname().lower(), "hostname"
    return name, origin


def resolve_node(cfg: ProxyConfig, *, kubernetes: bool, environ: Mapping[str, str] = os.environ,
                 hostname: Callable[[], str] = socket.gethostname,
                 primary: Callable[[], tuple[IPAddress, ...]] | None = None,
                 pod_cidrs: tuple[IPNetwork, ...] | None = None) -> NodeFacts:
    """The node's facts from the configuration and the environment.

    The name as node_name(). --nodeport-addresses "primary" asks `primary()` for the node's
    primary addresses. `pod_cidrs`: this Node's spec.podCIDRs, which detectLocalMode NodeCIDR
    needs (the agent reads them first: app/agent.node_facts). Raises ConfigError naming
    --nodeport-addresses when an entry is not a CIDR, or detectLocalMode as detector_of().
    """
    name, origin = node_name(cfg, kubernetes=kubernetes, environ=environ, hostname=hostname)
    if name is not None:
        log.info("node name %s (from %s)", name, origin)
    try:
        cidrs = parse_nodeport_addresses(cfg.nodeport_addresses)
    except ConfigError as err:
        raise ConfigError(str(err), obj="usproxy run") from None
    if cidrs is None:
        cidrs = _primary_cidrs((primary or primary_addresses)())
    node_cidrs = pod_cidrs if cfg.detect_local_mode == "NodeCIDR" else None
    return NodeFacts(name, cidrs, detector_of(cfg, node_cidrs, node=name), cfg.masquerade_all, node_cidrs)


def detector_of(cfg: ProxyConfig, pod_cidrs: tuple[IPNetwork, ...] | None = None, *,
                node: str | None = None, quiet: bool = False) -> LocalDetector:
    """kube-proxy's local-traffic detector from the configuration (getLocalDetectors,
    cmd/kube-proxy/app/server_linux.go). NodeCIDR takes `pod_cidrs`, Node `node`'s
    spec.podCIDRs (the first of each family; a family without one gets the no-op detector, as
    kube-proxy, which logs it). Raises ConfigError naming the field; NodeCIDR without
    `pod_cidrs` (not read) names detectLocalMode. `quiet`: a validation only, so the choice is
    logged once, when the agent builds its detector."""
    if cfg.detect_local_mode == "NodeCIDR" and pod_cidrs is None:
        raise ConfigError("NodeCIDR needs this Node's spec.podCIDRs, read before the agent is built",
                          obj="usproxy run", field="detectLocalMode")
    det = local_detector(cfg.detect_local_mode, cluster_cidrs=cfg.cluster_cidrs,
                         node_cidrs=tuple(str(n) for n in pod_cidrs or ()), bridge=cfg.bridge_interface,
                         prefix=cfg.interface_name_prefix)
    if quiet:
        return det
    if cfg.detect_local_mode == "ClusterCIDR" and not det.cidrs and not cfg.masquerade_all:
        log.info("no --cluster-cidr: ClusterIP traffic is not masqueraded (as kube-proxy without one)")
    if cfg.detect_local_mode == "NodeCIDR" and pod_cidrs is not None:
        for version in (4, 6):
            if not det.implemented(version):  # as kube-proxy, which logs this for the primary family
                log.info("detectLocalMode NodeCIDR: Node %s has no IPv%d pod CIDR; IPv%d ClusterIP "
                         "traffic is not masqueraded by the detector", node, version, version)
    return det


@dataclass(frozen=True, slots=True)
class NodePodCIDRs:
    """One v1 Node object as detectLocalMode NodeCIDR reads it: its name, whether it is being
    deleted (metadata.deletionTimestamp: kube-proxy's waitForPodCIDR does not take it), and
    spec.podCIDRs (spec.podCIDR when podCIDRs is absent, as objects of old servers), in order."""

    name: str
    deleting: bool
    pod_cidrs: tuple[IPNetwork, ...]


class PodCIDRsChanged(SourceError):
    """This Node's spec.podCIDRs changed under detectLocalMode NodeCIDR (the message says from
    what to what): the agent exits to be restarted, as kube-proxy (pkg/proxy/node.go)."""


def parse_node_pod_cidrs(raw: Mapping[str, Any]) -> NodePodCIDRs:
    """A raw Node -> NodePodCIDRs; CIDRs read as kube-proxy's ParseCIDRSloppy (leading zeros,
    host bits). Raises ConfigError naming the Node and spec.podCIDRs (or metadata.name)."""
    meta = raw.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ConfigError("required", obj="Node", field="metadata.name")
    obj = f"Node {name if is_dns1123_subdomain(name) else repr(name)}"  # quoted: no forged log lines
    spec = raw.get("spec")
    field, texts = _pod_cidr_texts(spec if isinstance(spec, Mapping) else {}, obj)
    out = []
    for i, text in enumerate(texts):
        where = f"{field}[{i}]" if field == "spec.podCIDRs" else field
        if not isinstance(text, str) or "/" not in text:  # a bare address is no CIDR (ParseCIDRSloppy)
            raise ConfigError(f"expected a CIDR (address/bits), got {text!r}", obj=obj, field=where)
        try:
            out.append(parse_cidr_sloppy(text))
        except ValueError as err:
            raise ConfigError(f"not a CIDR: {err}", obj=obj, field=where) from None
    deleting = isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))
    return NodePodCIDRs(name, deleting, tuple(out))


def _pod_cidr_texts(spec: Mapping[str, Any], obj: str) -> tuple[str, list[object]]:
    """(field, its entries): spec.podCIDRs, or spec.podCIDR alone when podCIDRs is absent."""
    texts = spec.get("podCIDRs")
    if texts is None:
        single = spec.get("podCIDR")
        return ("spec.podCIDR", [single]) if single else ("spec.podCIDRs", [])
    if not isinstance(texts, list):
        raise ConfigError(f"expected a list of CIDRs, got {type(texts).__name__}", obj=obj, field="spec.podCIDRs")
    return "spec.podCIDRs", texts


async def watch_nodeport_addresses(node: NodeFacts, clusterip_interface: str,
                                   on_change: Callable[[], Awaitable[None] | None], *,
                                   interval: float = 1.0,
                                   read: Callable[[], LocalAddresses] | None = None) -> None:
    """Call `on_change()` (awaited when it returns an awaitable) whenever the NodePort addresses
    (node.nodeport_ips over the local addresses `read` returns, default read_local_addresses:
    ~12 ms of CPU at 10,000 Services) polled every `interval` seconds in a worker thread differ
    from the last ones seen: the agent then has the BPF datapath read its tc addresses again and
    hands every datapath a full sync, so the relay's listeners, nftables' set nodeport-ips and
    BPF's usp_tc_addrs follow addresses as they come and go. A failed read is logged (once while it
    keeps failing the same way) and retried; runs until cancelled."""
    last: tuple[IPAddress, ...] | None = None
    failing = ""
    while True:
        try:
            local = await asyncio.to_thread(read) if read else await asyncio.to_thread(read_local_addresses, clusterip_interface)
        except Exception as err:  # netlink trouble must not stop the agent: the next poll retries
            if str(err) != failing:
                log.warning("reading local addresses: %s", err)
            failing = str(err)
        else:
            failing = ""
            ips = node.nodeport_ips(local, clusterip_interface)
            if last is not None and ips != last:
                log.info("NodePort addresses now: %s", ", ".join(str(ip) for ip in ips) or "none")
                if (pending := on_change()) is not None:
                    await pending
            last = ips
        await asyncio.sleep(interval)


def _primary_cidrs(ips: Iterable[IPAddress]) -> tuple[IPNetwork, ...]:
    """One /32 or /128 per family (kube-proxy server.go for "primary"); a family without a
    primary address serves NodePorts on every local address, as in kube-proxy."""
    out: dict[int, IPNetwork] = {}
    for ip in ips:
        if not ip.is_loopback and ip.version not in out:
            out[ip.version] = ipaddress.ip_network(ip)
    for version in (4, 6):
        if version not in out:
            log.warning("--nodeport-addresses primary: no primary IPv%d address; NodePorts on every "
                        "local IPv%d address", version, version)
    log.info("--nodeport-addresses primary: %s", ", ".join(str(n) for n in out.values()) or "none")
    return tuple(out[v] for v in sorted(out))


_RTM_GETADDR, _RTM_NEWADDR, _NLMSG_DONE, _NLMSG_ERROR = 22, 20, 3, 2
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2


def read_local_addresses(*skip_interfaces: str | None) -> LocalAddresses:
    """Every (interface name, address) of the calling thread's network namespace but those of
    `skip_interfaces`, by one RTM_GETADDR netlink dump parsed with struct. Blocking (call it from a
    worker thread). Not pyroute2: its parsing costs ~0.1 ms per address, and the ClusterIP
    interface (and IPVS's kube-ipvs0) holds one address per Service (1.2 s of CPU per read at
    10,000 Services); here those are skipped by their interface index before any attribute is
    read. Raises OSError."""
    names = dict(socket.if_nameindex())
    skip = {i for i, n in names.items() if n in skip_interfaces}
    return _dump_addresses(lambda index: index not in skip, names)


def interface_addresses(name: str) -> set[IPAddress] | None:
    """The addresses of interface `name` (None when it does not exist), read as
    read_local_addresses reads them. Blocking; raises OSError."""
    index = next((i for i, n in socket.if_nameindex() if n == name), None)
    if index is None:
        return None
    return {ip for _, ip in _dump_addresses(lambda i: i == index, {index: name})}


def _dump_addresses(keep: Callable[[int], bool], names: Mapping[int, str]) -> LocalAddresses:
    out: LocalAddresses = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(struct.pack("=LHHLLBBBBI", 24, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0, 0, 0, 0, 0, 0))
        while True:
            buf = sock.recv(1 << 20)
            if _parse_addresses(buf, keep, names, out):
                return out


def _parse_addresses(buf: bytes, keep: Callable[[int], bool], names: Mapping[int, str], out: LocalAddresses) -> bool:
    """Append the addresses of one netlink reply buffer to `out`; True at the end of the dump."""
    off = 0
    while off + 16 <= len(buf):
        length, kind = struct.unpack_from("=LH", buf, off)
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            code = -struct.unpack_from("=i", buf, off + 16)[0]
            raise OSError(code, f"netlink address dump: {os.strerror(code)}")
        if kind == _RTM_NEWADDR:
            index = struct.unpack_from("=I", buf, off + 20)[0]
            if keep(index):
                ip = _address_attr(buf, off + 24, off + length)
                if ip is not None:
                    out.append((names.get(index, "?"), ip))
        off += (length + 3) & ~3
    return False


def _address_attr(buf: bytes, start: int, end: int) -> IPAddress | None:
    """IFA_LOCAL (this end of a point-to-point link) or else IFA_ADDRESS of one message."""
    found: dict[int, bytes] = {}
    while start + 4 <= end:
        alen, atype = struct.unpack_from("=HH", buf, start)
        if atype in (_IFA_ADDRESS, _IFA_LOCAL):
            found[atype] = buf[start + 4:start + alen]
        start += (max(alen, 4) + 3) & ~3
    raw = found.get(_IFA_LOCAL) or found.get(_IFA_ADDRESS)
    return ipaddress.ip_address(raw) if raw is not None and len(raw) in (4, 16) else None


def primary_addresses() -> tuple[IPAddress, ...]:
    """The node's primary address per family: the preferred source of the family's default
    route, else the address of its interface whose subnet holds the gateway, else that
    interface's first global address. Runs in a thread of its own (callable from the loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_with_ipr, _primary).result()


def _with_ipr(fn: Callable[[Any], T]) -> T:
    from pyroute2 import IPRoute

    loop = asyncio.SelectorEventLoop()  # pyroute2 under a uvloop policy fails (docs/platform.md)
    try:
        with IPRoute(use_event_loop=loop) as ipr:
            return fn(ipr)
    finally:
        loop.close()


def _primary(ipr: Any) -> tuple[IPAddress, ...]:
    out = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for route in ipr.get_default_routes(family=family):
            ip = _route_source(ipr, route, family)
            if ip is not None:
                out.append(ip)
                break
    return tuple(out)


def _route_source(ipr: Any, route: Any, family: int) -> IPAddress | None:
    src = route.get_attr("RTA_PREFSRC")
    if src:
        return ipaddress.ip_address(src)
    gw = route.get_attr("RTA_GATEWAY")
    nets = [ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}")
            for a in ipr.get_addr(family=family, index=route.get_attr("RTA_OIF"))]
    nets = [n for n in nets if not n.ip.is_link_local and not n.ip.is_loopback]
    on_link = [n for n in nets if gw and ipaddress.ip_address(gw) in n.network]
    return (on_link or nets)[0].ip if nets else None
