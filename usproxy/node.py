"""NodeFacts: this node's identity, resolved once at start and handed to every part.

The Proxier (which endpoints are local), the relay (which addresses serve NodePorts) and the
nftables datapath (which endpoints may hairpin) must agree on the node; so the agent resolves it
once, before anything is built, and passes the same frozen value to each. Nothing changes it
later: what does change while running (the topology zone, whether the Node is being deleted) comes
from the Node object and is not a fact of this value.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from usproxy.config import ProxyConfig
from usproxy.errors import ConfigError
from usproxy.local_detector import LocalDetector, local_detector

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """This node as every part of the agent sees it.

    `name` is the Node's name (EndpointSlice endpoints with this nodeName are local), or None when
    it is unknown (a static source without --hostname-override or NODE_NAME): then no endpoint is
    known to be local. `nodeport_cidrs` restricts the addresses that serve NodePorts
    (--nodeport-addresses); empty means every local address but loopback. `detector` tells pod
    traffic from the rest and `masquerade_all` masquerades every ClusterIP connection (kube-proxy's
    detectLocalMode and masqueradeAll: both decide what the kernel datapaths masquerade).
    """

    name: str | None = None
    nodeport_cidrs: tuple[IPNetwork, ...] = ()
    detector: LocalDetector = LocalDetector()
    masquerade_all: bool = False


def resolve_node(cfg: ProxyConfig, *, kubernetes: bool, environ: Mapping[str, str] = os.environ,
                 hostname: Callable[[], str] = socket.gethostname) -> NodeFacts:
    """The node's facts from the configuration and the environment.

    The name is --hostname-override, else $NODE_NAME (the DaemonSet sets it from spec.nodeName),
    else, with a Kubernetes source, the lower-cased hostname (as kube-proxy,
    cmd/kube-proxy/app/server.go via utilnode.GetHostname); a static source without either has
    no name. Raises ConfigError naming --nodeport-addresses when a CIDR does not parse.
    """
    name = cfg.hostname_override or environ.get("NODE_NAME") or None
    origin = "--hostname-override" if cfg.hostname_override else "NODE_NAME"
    if name is None and kubernetes:
        name, origin = hostname().lower(), "hostname"
    if name is not None:
        log.info("node name %s (from %s)", name, origin)
    return NodeFacts(name, _cidrs(cfg.nodeport_addresses), detector_of(cfg), cfg.masquerade_all)


def detector_of(cfg: ProxyConfig) -> LocalDetector:
    """kube-proxy's local-traffic detector from the configuration. NodeCIDR needs the Node's
    spec.podCIDRs, which usproxy does not wait for (kube-proxy does): refused with the way out.
    Raises ConfigError naming the field."""
    if cfg.detect_local_mode == "NodeCIDR":
        raise ConfigError("NodeCIDR is not supported: give this node's pod CIDR as --cluster-cidr "
                          "(clusterCIDR) with detectLocalMode ClusterCIDR, which detects the same traffic",
                          obj="usproxy run", field="detectLocalMode")
    det = local_detector(cfg.detect_local_mode, cluster_cidrs=cfg.cluster_cidrs, bridge=cfg.bridge_interface,
                         prefix=cfg.interface_name_prefix)
    if cfg.detect_local_mode == "ClusterCIDR" and not det.cidrs and not cfg.masquerade_all:
        log.info("no --cluster-cidr: ClusterIP traffic is not masqueraded (as kube-proxy without one)")
    return det


def _cidrs(texts: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    out = []
    for text in texts:
        try:
            out.append(ipaddress.ip_network(text, strict=False))
        except ValueError as err:
            raise ConfigError(str(err), obj="usproxy run", field="--nodeport-addresses") from None
    return tuple(out)
