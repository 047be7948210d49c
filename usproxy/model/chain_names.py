"""Chain names exactly as kube-proxy forms them, for the iptables and nftables renderings.

iptables (pkg/proxy/iptables/proxier.go portProtoHash / servicePortEndpointChainName): SHA-256 of
"ns/name:port" + lower-case protocol (+ "ip:port" of the endpoint for KUBE-SEP), standard base32,
first 16 characters, after a prefix (KUBE-SVC-, KUBE-SVL-, KUBE-EXT-, KUBE-FW-, KUBE-SEP-).

nftables (pkg/proxy/nftables/proxier.go servicePortChainNameBase / hashAndTruncate): the readable
base "ns/name/proto/port" (+ "__ip/port" for endpoints, IPv6 colons turned into dots), prefixed by
the first 8 base32 characters of its own SHA-256 and a dash, truncated to 240 characters.
Invariant: pure functions of their arguments.
"""

from __future__ import annotations

from usproxy.model.endpoint import Endpoint
from usproxy.util.name_hash import name_hash
from usproxy.model.types import ServicePortName

NFT_NAME_MAX = 256  # knftables.NameLengthMax
NFT_PREFIX_MAX = 16  # chainNamePrefixLengthMax
NFT_BASE_MAX = NFT_NAME_MAX - NFT_PREFIX_MAX


def port_proto_hash(spn: ServicePortName) -> str:
    """The 16-character hash of a ServicePort (kube-proxy portProtoHash)."""
    return name_hash(str(spn) + spn.protocol.lower(), 16)


def svc_chain(spn: ServicePortName) -> str:
    """KUBE-SVC-*: the "Cluster" traffic policy chain."""
    return "KUBE-SVC-" + port_proto_hash(spn)


def svl_chain(spn: ServicePortName) -> str:
    """KUBE-SVL-*: the "Local" traffic policy chain."""
    return "KUBE-SVL-" + port_proto_hash(spn)


def ext_chain(spn: ServicePortName) -> str:
    """KUBE-EXT-*: where NodePort, externalIP and LoadBalancer traffic enters."""
    return "KUBE-EXT-" + port_proto_hash(spn)


def fw_chain(spn: ServicePortName) -> str:
    """KUBE-FW-*: loadBalancerSourceRanges of the LoadBalancer IPs."""
    return "KUBE-FW-" + port_proto_hash(spn)


def sep_chain(spn: ServicePortName, ep: Endpoint) -> str:
    """KUBE-SEP-*: one endpoint of one ServicePort."""
    return "KUBE-SEP-" + name_hash(str(spn) + spn.protocol.lower() + str(ep), 16)


def _hash_and_truncate(name: str) -> str:
    out = name_hash(name, 8) + "-" + name
    return out if len(out) <= NFT_BASE_MAX else out[:NFT_BASE_MAX - 3] + "..."


def nft_base(spn: ServicePortName) -> str:
    """"HASH-ns/name/proto/port", e.g. "ULMVA6XW-ns1/svc1/tcp/p80"."""
    return _hash_and_truncate(f"{spn.namespace}/{spn.name}/{spn.protocol.lower()}/{spn.port}")


def nft_endpoint_base(spn: ServicePortName, ep: Endpoint) -> str:
    """"HASH-ns/name/proto/port__ip/port", e.g. "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"."""
    ip = str(ep.ip).replace(":", ".")
    return _hash_and_truncate(
        f"{spn.namespace}/{spn.name}/{spn.protocol.lower()}/{spn.port}__{ip}/{ep.port}")
