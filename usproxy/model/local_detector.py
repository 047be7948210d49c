"""LocalDetector: which traffic comes from this cluster's pods, as kube-proxy's detect-local.

kube-proxy (pkg/proxy/util/localdetector.go, cmd/kube-proxy/app/server.go getLocalDetectors)
tells pod traffic from the rest by one of four modes: ClusterCIDR (source in the cluster's pod
CIDR), NodeCIDR (source in this node's pod CIDR), BridgeInterface (arrives on one bridge) and
InterfaceNamePrefix (arrives on an interface whose name starts with a prefix). The datapaths use
it for two things: ClusterIP traffic not from a pod is masqueraded, and pod traffic to an
externalTrafficPolicy Local Service's external addresses goes to every endpoint.

A detector may be unimplemented for a family (no CIDR of that family): then, as kube-proxy's
no-op detector, nothing is masqueraded by it and nothing is short-circuited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, TypeAlias

from usproxy.model.types import IPNetwork, parse_cidr_sloppy
from usproxy.util.errors import ConfigError

DetectLocalMode: TypeAlias = Literal["ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix"]
MODES: tuple[DetectLocalMode, ...] = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
# Linux interface names: at most 15 bytes, no '/', whitespace or quote (IFNAMSIZ and dev_valid_name);
# the name goes into nft rule text, so it is kept to characters that cannot end the quoted string.
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@+-]{1,15}$")


@dataclass(frozen=True, slots=True)
class LocalDetector:
    """How pod traffic is recognised. `cidrs`: at most one network per family (the first given
    of each family, as kube-proxy MapCIDRsByIPFamily(...)[0]); `interface`: a bridge name or a
    name prefix (by `mode`). The default detects nothing (kube-proxy's no-op detector)."""

    mode: DetectLocalMode | None = None
    cidrs: tuple[IPNetwork, ...] = ()
    interface: str = ""

    def implemented(self, family: Literal[4, 6]) -> bool:
        return self.if_local_nft(family) is not None

    def if_local_nft(self, family: Literal[4, 6]) -> str | None:
        """nft match for pod traffic in `family`'s table (None: not implemented there)."""
        return self._nft(family, "")

    def if_not_local_nft(self, family: Literal[4, 6]) -> str | None:
        """nft match for traffic not from a pod (kube-proxy's IfNotLocalNFT)."""
        return self._nft(family, "!= ")

    def _nft(self, family: Literal[4, 6], op: str) -> str | None:
        if self.mode in ("ClusterCIDR", "NodeCIDR"):
            for net in self.cidrs:
                if net.version == family:
                    return f"{'ip' if family == 4 else 'ip6'} saddr {op}{net}"
            return None
        if self.mode == "BridgeInterface":
            return f'iifname {op}"{self.interface}"'
        if self.mode == "InterfaceNamePrefix":
            return f'iifname {op}"{self.interface}*"'
        return None


def local_detector(mode: str, *, cluster_cidrs: tuple[str, ...] = (), node_cidrs: tuple[str, ...] = (),
                   bridge: str = "", prefix: str = "", where: str = "usproxy run") -> LocalDetector:
    """The detector `mode` selects, from the texts of the configuration. Raises ConfigError
    naming the field at fault: an unknown mode, a CIDR that does not parse (IPv4 with leading
    zeros is taken as kube-proxy's ParseCIDRSloppy does), a missing or malformed interface name.
    ClusterCIDR without a cluster CIDR is kube-proxy's no-op detector (it only logs)."""
    if mode not in MODES:
        raise ConfigError(f"must be one of {', '.join(MODES)}, got {mode!r}", obj=where, field="detectLocalMode")
    if mode in ("ClusterCIDR", "NodeCIDR"):
        texts, name = (cluster_cidrs, "clusterCIDR") if mode == "ClusterCIDR" else (node_cidrs, "podCIDRs")
        nets = [_cidr(t, name, where) for t in texts]
        firsts = tuple(next(n for n in nets if n.version == v) for v in (4, 6) if any(n.version == v for n in nets))
        return LocalDetector(mode, firsts) if firsts else LocalDetector()  # no CIDR: the no-op detector
    value, name = (bridge, "detectLocal.bridgeInterface") if mode == "BridgeInterface" else (
        prefix, "detectLocal.interfaceNamePrefix")
    if not _IFNAME.match(value):
        raise ConfigError(f"detectLocalMode {mode} needs an interface name (at most 15 of "
                          f"[A-Za-z0-9_.:@+-]), got {value!r}", obj=where, field=name)
    return LocalDetector(mode, (), value)


def _cidr(text: str, name: str, where: str) -> IPNetwork:
    try:
        return parse_cidr_sloppy(text)
    except ValueError as err:
        raise ConfigError(f"not a CIDR: {err}", obj=where, field=name) from None
