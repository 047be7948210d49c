"""IPv6 for the field-case topology (C23), as helper functions over tests.netns.Topology.

`Topology` stays IPv4-only; these add the documentation prefixes of the field cases:
2001:db8:244::/56 for pods and clients, 2001:db8:96::/112 for ClusterIPs. `enable_ipv6()` gives
the node bridge 2001:db8:244::1/56; `add_address6()` puts /128 addresses on a host made by
`Topology.add_host`, with an on-link route for the pod prefix and the ClusterIP range routed via
the node. Addresses are added without duplicate address detection (nodad), so they are usable at
once. Everything lives in the topology's namespaces and goes with them.
"""

from __future__ import annotations

from tests.netns import Topology, nsexec

NODE6 = "2001:db8:244::1"
POD_PREFIX6 = "2001:db8:244::/56"
SERVICE_PREFIX6 = "2001:db8:96::/112"


def enable_ipv6(topo: Topology) -> None:
    """The node's side: its bridge gets NODE6 (the pods' gateway and the relay's source address)."""
    nsexec(topo.node, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0")
    nsexec(topo.node, "ip", "-6", "addr", "add", f"{NODE6}/56", "dev", "usbr0", "nodad")


def add_address6(ns: str, *addresses: str) -> None:
    """IPv6 `addresses` on host `ns` (made by `Topology.add_host`), with routes to pods and
    ClusterIPs."""
    nsexec(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0")
    for a in addresses:
        nsexec(ns, "ip", "-6", "addr", "add", f"{a}/128", "dev", "eth0", "nodad")
    nsexec(ns, "ip", "-6", "route", "add", POD_PREFIX6, "dev", "eth0")
    nsexec(ns, "ip", "-6", "route", "add", SERVICE_PREFIX6, "via", NODE6, "dev", "eth0")
