"""The userspace proxy: kube-proxy 1.0's portals and proxy table, then usproxy's own form of it.

kube-proxy 1.0 (pkg/proxy/userspace/proxier.go, iptablesContainerPortalArgs /
iptablesHostPortalArgs) opened one listener per ServicePort on 0.0.0.0:<random proxy port> and
steered traffic to it with iptables: KUBE-PORTALS-CONTAINER (PREROUTING, REDIRECT --to-ports) and
KUBE-PORTALS-HOST (OUTPUT, DNAT to the node IP) for ClusterIPs and externalIPs, KUBE-NODEPORT-
CONTAINER / KUBE-NODEPORT-HOST for NodePorts. Its LoadBalancerRR picked endpoints round robin with
optional ClientIP stickiness. Rules are printed as iptables-save prints them. Proxy ports are random
at run time; here they are stable placeholders derived from the ServicePortName.

usproxy keeps the relay but drops the redirection: the ClusterIP is a local address on usproxy0 and
the listener binds ClusterIP:port itself (docs/architecture.md#life-of-a-serviceport), so no rule
stands between the client and the socket; without usable endpoints it does not listen and the kernel
refuses at once.
"""

from __future__ import annotations

import hashlib

from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.util.table import render_table
from usproxy.model.types import format_hostport

VIP_INTERFACE = "usproxy0"


def proxy_port(fp: FamilyPort) -> int:
    """A stable stand-in for the random port kube-proxy 1.0 listened on (32768-60999)."""
    digest = hashlib.sha256(f"{fp.name.key()}".encode()).digest()
    return 32768 + int.from_bytes(digest[:4], "big") % (61000 - 32768)


def _portal(chain: str, dst: str, fp: FamilyPort, dport: int, target: str) -> str:
    d = f"-d {dst} " if dst else ""
    return (f'-A {chain} {d}-p {fp.proto} -m comment --comment "{fp.name.service}:{fp.name.port}" '
            f"-m {fp.proto} --dport {dport} {target}")


def portal_rules(ss: ServiceSet) -> str:
    """iptables-save -t nat of kube-proxy 1.0's portal chains (IPv4: 1.0 had no IPv6 portals)."""
    host = str(ss.node.ips_of(4)[0]) if ss.node.ips_of(4) else "NODE_IP"
    lines = ["*nat", ":KUBE-NODEPORT-CONTAINER - [0:0]", ":KUBE-NODEPORT-HOST - [0:0]",
             ":KUBE-PORTALS-CONTAINER - [0:0]", ":KUBE-PORTALS-HOST - [0:0]",
             '-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: this must be before the '
             'NodePort rules" -j KUBE-PORTALS-CONTAINER',
             '-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "handle service '
             'NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-CONTAINER',
             '-A OUTPUT -m comment --comment "handle ClusterIPs; NOTE: this must be before the '
             'NodePort rules" -j KUBE-PORTALS-HOST',
             '-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment "handle service '
             'NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-HOST']
    for fp in ss.family_ports(4):
        pp = proxy_port(fp)
        for ip in (fp.cluster_ip, *fp.external_ips, *fp.lb_ips):
            lines.append(_portal("KUBE-PORTALS-CONTAINER", f"{ip}/32", fp, fp.sp.port,
                                 f"-j REDIRECT --to-ports {pp}"))
            lines.append(_portal("KUBE-PORTALS-HOST", f"{ip}/32", fp, fp.sp.port,
                                 f"-j DNAT --to-destination {host}:{pp}"))
        if fp.sp.node_port:
            lines.append(_portal("KUBE-NODEPORT-CONTAINER", "", fp, fp.sp.node_port,
                                 f"-j REDIRECT --to-ports {pp}"))
            lines.append(_portal("KUBE-NODEPORT-HOST", "", fp, fp.sp.node_port,
                                 f"-j DNAT --to-destination {host}:{pp}"))
    return "\n".join([*lines, "COMMIT"]) + "\n"


def _affinity(fp: FamilyPort, minutes: bool) -> str:
    if fp.sp.session_affinity != "ClientIP":
        return "None"
    t = fp.sp.affinity_timeout
    return f"ClientIP ({t // 60} min)" if minutes else f"ClientIP ({t}s)"


def proxy_table(ss: ServiceSet) -> str:
    """kube-proxy 1.0's own table: ServicePort -> listener, endpoints in round-robin order."""
    rows = []
    for fp in ss.family_ports(4):
        eps = ", ".join(str(ep) for ep in fp.cluster) or "<none: connections accepted, then closed>"
        rows.append([f"{fp.name.service}:{fp.name.port}", fp.sp.protocol,
                     f"0.0.0.0:{proxy_port(fp)}", eps, "round robin", _affinity(fp, True)])
    return render_table(["SERVICE PORT", "PROTO", "LISTENER", "ENDPOINTS", "POLICY", "AFFINITY"], rows) + "\n"


def usproxy_form(ss: ServiceSet) -> str:
    """usproxy's relay: ClusterIPs as local addresses, listeners, endpoints, policy, flows."""
    addrs, rows = [], []
    for family in ss.families():
        for fp in ss.family_ports(family):
            plen = 32 if family == 4 else 128
            addr = f"    {'inet' if family == 4 else 'inet6'} {fp.cluster_ip}/{plen} scope host {VIP_INTERFACE}"
            if addr not in addrs:
                addrs.append(addr)
            listens = [format_hostport(fp.cluster_ip, fp.sp.port)]
            listens += [format_hostport(ip, fp.sp.node_port) for ip in ss.node.ips_of(family)
                        if fp.sp.node_port]
            if fp.sp.node_port and not ss.node.ips_of(family):
                listens.append(f"*:{fp.sp.node_port}")
            usable = fp.internal
            listener = ", ".join(listens) if usable else "not listening (kernel refuses: " + (
                "TCP RST)" if fp.sp.protocol == "TCP" else "ICMP port unreachable)")
            rows.append([fp.name.key(), listener, ", ".join(map(str, usable)) or "<none>",
                         fp.sp.lb_policy or "roundRobin", _affinity(fp, False), fp.sp.datapath or "auto"])
    table = render_table(["SERVICE PORT", "LISTENER", "ENDPOINTS", "POLICY", "AFFINITY", "DATAPATH"], rows)
    return (f"# ip addr show {VIP_INTERFACE}\n{VIP_INTERFACE}: <BROADCAST,NOARP,UP,LOWER_UP>\n"
            + "\n".join(addrs) + f"\n\n# relay listeners\n{table}\n\n"
            "# flow table\n(none here: this section renders the input; a running agent's flows are in the live "
            "section, with `--live`)\n")


def render(ss: ServiceSet) -> str:
    return ("# kube-proxy 1.0 (userspace mode): iptables-save -t nat\n" + portal_rules(ss)
            + "\n# kube-proxy 1.0 proxy table\n" + proxy_table(ss)
            + "\n# usproxy's form of it\n" + usproxy_form(ss))
