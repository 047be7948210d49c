"""The mapping from kube-proxy's test addresses to this suite's network namespaces.

kube-proxy's fake proxier uses 172.30.0.0/16 ClusterIPs, 10.0.0.0/8 pods, 192.168.0.2 as the node,
and public addresses (1.2.3.4, 5.6.7.8, 9.10.11.12) as LoadBalancer IPs. Here every address lands
in a range the tests own (tests/netns.py's node: bridge usbr0 with 10.244.0.1/16, 192.0.2.10/24,
192.0.2.11/24) and public ones in the documentation ranges. Scenarios that share one agent must
not collide, so ClusterIPs, LoadBalancer/external IPs and NodePorts carry the scenario's index
`k` (1-based, unique within its group):

| kube-proxy                   | here                                   | role                       |
|------------------------------|----------------------------------------|----------------------------|
| 172.30.0.X                   | 10.96.k.X                              | ClusterIPs (Service CIDR)  |
| 172.30.1.1                   | 10.96.k.201                            | ClusterIP                  |
| 172.30.0.0/16                | 10.96.0.0/16                           | Service CIDR               |
| 10.180.A.B                   | 10.244.(100+A).B                       | pods (endpoints, clients)  |
| 10.180.1.B ("remote" node)   | 10.244.101.B, behind netns "peer"      | pods on another node       |
| 10.0.A.B                     | 10.244.A.B                             | pods; 10.0.0.2 the client  |
| 192.168.0.2 / 192.168.1.2    | 192.0.2.10 / 192.0.2.11                | node IP / alternate node IP|
| 192.168.0.0/24               | 192.0.2.10/32                          | the node IP's network: not |
|                              |                                        | the alternate node IP's    |
| 192.168.1.0/24               | 192.0.2.0/24                           | node networks (CIDRs)      |
| 1.2.3.4, 5.6.7.8, 9.10.11.12 | 198.51.100.(10k+1), (10k+2), (10k+3)   | LoadBalancer ingress IPs   |
| 192.168.99.11, .22, .33      | 198.51.100.(10k+4), (10k+5), (10k+6)   | externalIPs                |
| 203.0.113.2, 203.0.113.130   | unchanged                              | external clients           |
| 127.0.0.1, 2001:db8::/64     | unchanged                              | localhost, a v6 CIDR       |
| NodePort 3000+i              | 31000+10k+i                            | (kube-proxy uses 300x)     |
| healthCheckNodePort 30000+i  | 32000+10k+i                            |                            |
| node name "test-node"        | unchanged (--hostname-override)        |                            |

The node also holds 203.0.113.1/24 (the external clients' gateway) and reaches the rest of the
world through netns "world" (10.255.255.2), which answers every packet it is sent with ICMP host
unreachable: traffic the proxy does not handle gets a fast error there, never a silent loss.

The pods of TestInternalExternalMasquerade's "remote" node (kube-proxy's 10.180.1.B, its only
endpoints on another node that no scenario also names local) live behind netns "peer", a second
node on the node bridge (PEER_NODE) with a pod bridge of its own (PEER_PODS): the node routes them
through it, so a datapath that returns directly from the endpoint's node (DSR) really has one.
Every other pod address sits on the node's bridge, whatever node its slice names.
"""

from __future__ import annotations

import ipaddress

NODE_ADDRESSES = ("192.0.2.10", "192.0.2.11", "10.244.0.1", "203.0.113.1")
EXT_GATEWAY = "203.0.113.1"
WORLD_LINK = ("10.255.255.1", "10.255.255.2")  # node side, world side (/30)
PEER_NODE = "10.244.0.250"  # the peer node's address on the node bridge: the node's route to PEER_PODS
PEER_PODS = "10.244.101.0/24"  # kube-proxy's 10.180.1.0/24, the "remote" node's pods
PEER_BRIDGE = "10.244.101.254"  # the peer node's pod bridge, its pods' gateway
MAX_K = 24  # 10k+6 must stay within 198.51.100.0/24

_LB = {"1.2.3.4": 1, "5.6.7.8": 2, "9.10.11.12": 3, "192.168.99.11": 4, "192.168.99.22": 5, "192.168.99.33": 6}
_FIXED = {"192.168.0.2": "192.0.2.10", "192.168.1.2": "192.0.2.11",
          "203.0.113.2": "203.0.113.2", "203.0.113.130": "203.0.113.130", "127.0.0.1": "127.0.0.1"}
_CIDRS = {"172.30.0.0/16": "10.96.0.0/16", "192.168.0.0/24": "192.0.2.10/32", "192.168.1.0/24": "192.0.2.0/24", "192.168.0.2/32": "192.0.2.10/32",
          "203.0.113.0/25": "203.0.113.0/25", "127.0.0.1/32": "127.0.0.1/32", "2001:db8::/64": "2001:db8::/64"}


def addr(kp: str, k: int) -> str:
    """The address here for kube-proxy's `kp` in the scenario of index `k`; ValueError if unmapped."""
    if not 1 <= k <= MAX_K:
        raise ValueError(f"scenario index {k} out of 1..{MAX_K}")
    if kp in _FIXED:
        return _FIXED[kp]
    if kp in _LB:
        return f"198.51.100.{10 * k + _LB[kp]}"
    a, b, c, d = (int(x) for x in kp.split("."))
    if (a, b) == (172, 30):
        return f"10.96.{k}.{d}" if c == 0 else f"10.96.{k}.{200 + d}" if (c, d) == (1, 1) else _fail(kp)
    if (a, b) == (10, 180):
        return f"10.244.{100 + c}.{d}"
    if a == 10 and b == 0:
        return f"10.244.{c}.{d}"
    return _fail(kp)


def cidr(kp: str) -> str:
    """kube-proxy's CIDR (LoadBalancerSourceRanges, nodePortAddresses; whitespace kept) mapped here."""
    key = kp.strip()
    if key not in _CIDRS:
        raise ValueError(f"no mapping for CIDR {kp!r}")
    return kp.replace(key, _CIDRS[key])


def node_port(kp: int, k: int) -> int:
    """NodePort (3000+i) or healthCheckNodePort (30000+i) of scenario `k`."""
    if 3000 <= kp < 3010:
        return 31000 + 10 * k + kp - 3000
    if 30000 <= kp < 30010:
        return 32000 + 10 * k + kp - 30000
    raise ValueError(f"no mapping for port {kp}")


def is_node(ip: str) -> bool:
    return ip in NODE_ADDRESSES


def is_external_client(ip: str) -> bool:
    return ipaddress.ip_address(ip) in ipaddress.ip_network("203.0.113.0/24") and ip != EXT_GATEWAY


def on_peer_node(ip: str) -> bool:
    """Whether pod address `ip` (mapped) lives behind the peer node, not on the node's bridge."""
    return ipaddress.ip_address(ip) in ipaddress.ip_network(PEER_PODS)


def _fail(kp: str) -> str:
    raise ValueError(f"no mapping for address {kp!r}")
