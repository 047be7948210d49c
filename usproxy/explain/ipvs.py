"""The IPVS view: what kube-proxy's IPVS mode installs for a ServiceSet, as its tools list it.

The state is the IPVS datapath's own generator (usproxy/offload/ipvs/rules.py: virtual servers,
kube-ipvs0's addresses, the ipsets and the iptables rules of pkg/proxy/ipvs/proxier.go); this
module only formats it: `ipvsadm -Ln` (services sorted by protocol, address, port; real servers
by address), `ip addr show kube-ipvs0`, `ipset save` (every set, in kube-proxy's order, members
sorted) and the iptables-restore input, then the entry jumps as `iptables-save` lists them. The
IPVS datapath installs exactly this (tests/offload/ipvs: the live `ipvsadm -Ln`, `ipset save` and
`iptables-save` are compared with it).
"""

from __future__ import annotations

from usproxy.model.service_set import ServiceSet
from usproxy.model.types import Family, IPAddress, format_hostport
from usproxy.offload.ipvs import rules
from usproxy.offload.ipvs.rules import DUMMY, IPVS_FILTER, PROXY_FIREWALL, VirtualServer

__all__ = ["DUMMY", "IPVS_FILTER", "PROXY_FIREWALL", "dummy_addresses", "ip_addr", "ipset_save", "iptables_helpers",
           "ipvsadm", "render", "virtual_servers"]


def tables(ss: ServiceSet, family: Family) -> rules.Tables:
    """The generator's state for `family`; NodePort virtual servers on --node-ip's addresses."""
    return rules.tables(ss.family_ports(family), ss.node, family, ss.node.ips_of(family))


def virtual_servers(ss: ServiceSet, family: Family) -> list[VirtualServer]:
    return sorted(tables(ss, family).servers().values(), key=VirtualServer.sort_key)


def ipvsadm(vss: list[VirtualServer]) -> str:
    """`ipvsadm -Ln`."""
    lines = ["IP Virtual Server version 1.2.1 (size=4096)",
             "Prot LocalAddress:Port Scheduler Flags",
             "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn"]
    for vs in sorted(vss, key=VirtualServer.sort_key):
        flags = f" persistent {vs.persistent}" if vs.persistent else ""
        lines.append(f"{vs.proto:<4} {format_hostport(vs.address, vs.port)} {vs.scheduler}{flags}")
        for rs in vs.reals:
            lines.append(f"  -> {str(rs):<28} {'Masq':<7} {1:<6} {0:<10} {0:<10}".rstrip())
    return "\n".join(lines) + "\n"


def dummy_addresses(ss: ServiceSet, family: Family) -> list[IPAddress]:
    """Addresses kube-proxy binds to kube-ipvs0: ClusterIPs, externalIPs, LoadBalancer IPs."""
    return tables(ss, family).bound_addresses()


def ip_addr(addrs: list[IPAddress]) -> str:
    lines = [f"{DUMMY}: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN group default"]
    for ip in addrs:
        inet, plen = ("inet", 32) if ip.version == 4 else ("inet6", 128)
        lines.append(f"    {inet} {ip}/{plen} scope global {DUMMY}")
    return "\n".join(lines) + "\n"


def ipset_save(ss: ServiceSet, family: Family) -> str:
    """`ipset save`: every set kube-proxy creates, empty or not."""
    return rules.ipset_save(tables(ss, family))


def iptables_helpers(ss: ServiceSet, family: Family) -> str:
    """iptables-restore input: writeIptablesRules' nat and filter tables."""
    return tables(ss, family).restore_input()


def render(ss: ServiceSet) -> str:
    parts = []
    for family in ss.families():
        t = tables(ss, family)
        tool = "iptables" if family == 4 else "ip6tables"
        note = "" if ss.node.ips_of(family) else \
            "# (NodePort virtual servers exist per node address; pass --node-ip to list them)\n"
        vss = sorted(t.servers().values(), key=VirtualServer.sort_key)
        parts.append(
            f"# ipvsadm -Ln   (IPv{family})\n{note}{ipvsadm(vss)}\n"
            f"# ip addr show {DUMMY}\n{ip_addr(t.bound_addresses())}\n"
            f"# ipset save\n{rules.ipset_save(t)}\n"
            f"# {tool}-restore input (the rules kube-proxy's IPVS mode still needs: masquerade, NodePorts, "
            f"firewalls)\n{t.restore_input()}\n"
            f"# entry jumps: kube-proxy inserts these with `{tool} -I` (iptablesJumpChain), outside the input "
            f"above; `{tool}-save` lists them so:\n{rules.render_jumps()}")
    return "\n".join(parts) if parts else "# no Services with a ClusterIP\n"
