"""Shared names of the proxy model (as kube-proxy pkg/proxy/types.go).

ServicePortName is the key of everything: namespace/name:portName plus protocol. Protocol is part
of the key, so TCP 53 and UDP 53 of one Service are two ServicePorts (field case C22).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Literal, NamedTuple, TypeAlias

Protocol: TypeAlias = Literal["TCP", "UDP", "SCTP"]
PROTOCOLS: tuple[Protocol, ...] = ("TCP", "UDP", "SCTP")
_PROTOCOL: dict[str, Protocol] = {p: p for p in PROTOCOLS}
IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
Family: TypeAlias = Literal[4, 6]  # an IP family, as ipaddress' `version`
FAMILIES: tuple[Family, ...] = (4, 6)
# Which endpoints of a ServicePort a frontend uses: "cluster" for its ClusterIPs (internal traffic
# policy), "external" for its NodePorts, externalIPs and LoadBalancer IPs (externalTrafficPolicy).
Scope: TypeAlias = Literal["cluster", "external"]


class NamespacedName(NamedTuple):
    """namespace/name of one API object. A NamedTuple (as ServicePortName): immutable, ordered,
    and hashed in C; every map of the model is keyed by these, and a cold sync of 10,000 Services
    spent a fifth of its time in the Python-level hashes of frozen dataclasses."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class ServicePortName(NamedTuple):
    """One port of one Service: namespace/name:port plus protocol.

    `str()` follows kube-proxy's ServicePortName.String(): "ns/name:port", or "ns/name" for an
    unnamed port; the protocol is shown by `key()` ("ns/name:port/TCP").
    """

    namespace: str
    name: str
    port: str
    protocol: Protocol

    @property
    def service(self) -> NamespacedName:
        return NamespacedName(self.namespace, self.name)

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base

    def key(self) -> str:
        return f"{self} {self.protocol}".replace(" ", "/")

    @classmethod
    def from_key(cls, text: str) -> ServicePortName | None:
        """Inverse of key(): "ns/name:port/TCP" or "ns/name/TCP" back to the ServicePortName.
        None when `text` is not one: no known protocol, or an empty namespace or name (no API
        object has one). How both kernel datapaths attribute what they read back (nftables
        element comments, BPF service group names)."""
        rest, _, proto = text.rpartition("/")
        namespace, _, name_port = rest.partition("/")
        name, _, port = name_port.partition(":")
        protocol = _PROTOCOL.get(proto)
        if protocol is None or not namespace or not name:
            return None
        return cls(namespace, name, port, protocol)


def format_hostport(ip: IPAddress | str, port: int) -> str:
    """"ip:port" for IPv4, "[ip]:port" for IPv6 (field case C23)."""
    text = str(ip)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"


_V4_SLOPPY = re.compile(r"^([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)$")


def sloppy_ip_text(text: str) -> str:
    """`text` with the leading zeros of a dotted-quad IPv4 address dropped ("010.000.000.001" ->
    "10.0.0.1"), each part read as decimal, as kube-proxy's netutils.ParseIPSloppy (Go's parser
    before 1.17) does; any other text is returned unchanged for ipaddress to judge."""
    m = _V4_SLOPPY.match(text)
    if m is None or any(int(p) > 255 for p in m.groups()):
        return text
    return ".".join(str(int(p)) for p in m.groups())


def unmapped(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:192.0.2.20) as the IPv4 address it carries, as Go's
    net.IP (To4) and so kube-proxy's IPFamilyOf read it; any other address unchanged. Without
    this, a mapped address is classed IPv6 and escapes every IPv4 check (issue 29 item 5)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def unmapped_network(net: IPNetwork) -> IPNetwork:
    """An IPv6 network inside ::ffff:0:0/96 as the IPv4 network it covers (::ffff:192.0.2.0/120
    -> 192.0.2.0/24, ::ffff:0:0/96 -> 0.0.0.0/0), as kube-proxy's IPFamilyOfCIDR and
    IPNet.String() read it; any other network unchanged. A mapped network address implies a
    prefix of at least 96 (the ffff bits sit at 80-95)."""
    if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped is not None:
        return ipaddress.IPv4Network((net.network_address.ipv4_mapped, net.prefixlen - 96))
    return net


_V4_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_V4_CANONICAL = re.compile(rf"{_V4_OCTET}(?:\.{_V4_OCTET}){{3}}")  # no leading zeros, each part <= 255


def parse_ip_sloppy(text: str) -> IPAddress:
    """An address as kube-proxy parses Service and EndpointSlice addresses (ParseIPSloppy:
    IPv4 leading zeros are decimal; an IPv4-mapped IPv6 address is the IPv4 address, see
    `unmapped`). Raises ValueError as ipaddress.ip_address."""
    if _V4_CANONICAL.fullmatch(text):  # the common case, packed in C (ipaddress parses in Python)
        return ipaddress.IPv4Address(socket.inet_aton(text))
    return unmapped(ipaddress.ip_address(sloppy_ip_text(text)))


def parse_cidr_sloppy(text: str) -> IPNetwork:
    """A CIDR as kube-proxy parses them (netutils.ParseCIDRSloppy): IPv4 leading zeros are
    decimal, host bits are allowed ("010.244.000.005/16" -> 10.244.0.0/16); a bare address is a
    host route; an IPv4-mapped range is the IPv4 range (`unmapped_network`). Raises ValueError
    as ipaddress.ip_network."""
    addr, slash, bits = text.strip().partition("/")
    return unmapped_network(ipaddress.ip_network(f"{sloppy_ip_text(addr)}{slash}{bits}", strict=False))


def refused_address(ip: IPAddress) -> str | None:
    """Why an address can be neither a Service frontend nor an Endpoint (loopback, link-local,
    multicast, unspecified: serving or relaying to it would open a path to node-local services
    or to every address), or None when it is acceptable."""
    if ip.version == 4:  # ipaddress's own tests, by integer (they cost a network lookup each)
        n = int(ip)
        if n >> 24 == 127:
            return "loopback"
        if n >> 16 == 0xA9FE:
            return "link-local"
        if n >> 28 == 0xE:
            return "multicast"
        return "unspecified" if n == 0 else None
    for attr in ("is_loopback", "is_link_local", "is_multicast", "is_unspecified"):
        if getattr(ip, attr):
            return attr.removeprefix("is_").replace("_", "-")
    return None
