"""What kube-proxy's IPVS mode installs for a ServiceSet: virtual servers, kube-ipvs0, ipsets, iptables.

Follows kube-proxy pkg/proxy/ipvs/proxier.go: one virtual server (scheduler rr, `persistent
<timeout>` for ClientIP affinity) per ClusterIP, externalIP, LoadBalancer IP and node address:NodePort,
with Masq real servers of weight 1 (Local policy: this node's endpoints, falling back to the
cluster-wide ones as syncEndpoint does); every virtual address bound to the kube-ipvs0 dummy device;
the ipsets of ipset.go (IPv6 names use the KUBE-6- prefix); and writeIptablesRules' helper rules:
the nat table's, and, when a LoadBalancer IP has loadBalancerSourceRanges, the filter table's
KUBE-PROXY-FIREWALL / KUBE-SOURCE-RANGES-FIREWALL rules that drop other sources (the per-LB-IP
KUBE-IPVS-OUT-FILTER rules that keep the node itself out when no range holds it are not shown).
Listing formats: `ipvsadm -Ln` (services sorted by protocol, address, port), `ip addr show
kube-ipvs0`, `ipset save`, iptables-restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_set import FamilyPort, Node, ServiceSet
from usproxy.model.types import Family, IPAddress, format_hostport

DUMMY = "kube-ipvs0"
PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
SOURCE_RANGES_FIREWALL = "KUBE-SOURCE-RANGES-FIREWALL"
SET_COMMENTS = {
    "KUBE-LOOP-BACK": "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
    "KUBE-CLUSTER-IP": "Kubernetes service cluster ip + port for masquerade purpose",
    "KUBE-EXTERNAL-IP": "Kubernetes service external ip + port for masquerade and filter purpose",
    "KUBE-EXTERNAL-IP-LOCAL": "Kubernetes service external ip + port with externalTrafficPolicy=local",
    "KUBE-LOAD-BALANCER": "Kubernetes service lb portal",
    "KUBE-LOAD-BALANCER-LOCAL": "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
    "KUBE-LOAD-BALANCER-FW": "Kubernetes service load balancer ip + port for load balancer with sourceRange",
    "KUBE-LOAD-BALANCER-SOURCE-IP":
        "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR":
        "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
    "KUBE-NODE-PORT-TCP": "Kubernetes nodeport TCP port for masquerade purpose",
    "KUBE-NODE-PORT-LOCAL-TCP": "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
    "KUBE-NODE-PORT-UDP": "Kubernetes nodeport UDP port for masquerade purpose",
    "KUBE-NODE-PORT-LOCAL-UDP": "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
    "KUBE-IPVS-IPS": "Addresses on the ipvs interface",
}
SET_TYPES = {"KUBE-LOOP-BACK": "hash:ip,port,ip", "KUBE-IPVS-IPS": "hash:ip",
             "KUBE-LOAD-BALANCER-SOURCE-IP": "hash:ip,port,ip",
             "KUBE-LOAD-BALANCER-SOURCE-CIDR": "hash:ip,port,net"}


@dataclass(frozen=True, slots=True)
class VirtualServer:
    """One IPVS service and its real servers."""

    proto: str  # "TCP", "UDP", "SCTP"
    address: IPAddress
    port: int
    scheduler: str
    persistent: int | None
    reals: tuple[Endpoint, ...]
    fp: FamilyPort
    kind: str  # "cluster IP", "external IP", "loadbalancer IP", "node port"

    def key(self) -> tuple[str, int, bytes, int]:
        return (self.proto, self.address.version, self.address.packed, self.port)


def _reals(fp: FamilyPort, local_only: bool) -> tuple[Endpoint, ...]:
    """syncEndpoint: Local policy uses local endpoints, or the cluster-wide ones if there are none."""
    if local_only and fp.local:
        return fp.local
    return fp.cluster if fp.uses_cluster_endpoints else fp.local


def virtual_servers(ss: ServiceSet, family: Family) -> list[VirtualServer]:
    out = []
    for fp in ss.family_ports(family):
        persistent = fp.sp.affinity_timeout if fp.sp.session_affinity == "ClientIP" else None

        def vs(addr: IPAddress, port: int, local: bool, kind: str) -> VirtualServer:
            return VirtualServer(fp.sp.protocol, addr, port, "rr", persistent, _reals(fp, local),
                                 fp, kind)

        out.append(vs(fp.cluster_ip, fp.sp.port, fp.internal_policy_local, "cluster IP"))
        out += [vs(ip, fp.sp.port, fp.external_policy_local, "external IP") for ip in fp.external_ips]
        out += [vs(ip, fp.sp.port, fp.external_policy_local, "loadbalancer IP") for ip in fp.lb_ips]
        if fp.sp.node_port:
            out += [vs(ip, fp.sp.node_port, fp.external_policy_local, "node port")
                    for ip in ss.node.ips_of(family)]
    return sorted(out, key=VirtualServer.key)


def ipvsadm(vss: list[VirtualServer]) -> str:
    """`ipvsadm -Ln`."""
    lines = ["IP Virtual Server version 1.2.1 (size=4096)",
             "Prot LocalAddress:Port Scheduler Flags",
             "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn"]
    for vs in vss:
        flags = f" persistent {vs.persistent}" if vs.persistent else ""
        lines.append(f"{vs.proto:<4} {format_hostport(vs.address, vs.port)} {vs.scheduler}{flags}")
        for rs in sorted(vs.reals, key=lambda e: (e.ip.packed, e.port)):
            lines.append(f"  -> {str(rs):<28} {'Masq':<7} {1:<6} {0:<10} {0:<10}".rstrip())
    return "\n".join(lines) + "\n"


def dummy_addresses(ss: ServiceSet, family: Family) -> list[IPAddress]:
    """Addresses kube-proxy binds to kube-ipvs0: ClusterIPs, externalIPs, LoadBalancer IPs."""
    seen: dict[IPAddress, None] = {}
    for fp in ss.family_ports(family):
        for ip in (fp.cluster_ip, *fp.external_ips, *fp.lb_ips):
            seen[ip] = None
    return sorted(seen, key=lambda ip: ip.packed)


def ip_addr(addrs: list[IPAddress]) -> str:
    lines = [f"{DUMMY}: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN group default"]
    for ip in addrs:
        inet, plen = ("inet", 32) if ip.version == 4 else ("inet6", 128)
        lines.append(f"    {inet} {ip}/{plen} scope global {DUMMY}")
    return "\n".join(lines) + "\n"


def _entry(ip: IPAddress, proto: str, port: int) -> str:
    return f"{ip},{proto}:{port}"


def _set_entries(ss: ServiceSet, family: Family) -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {name: [] for name in SET_COMMENTS}
    for fp in ss.family_ports(family):
        p, port = fp.proto, fp.sp.port
        sets["KUBE-CLUSTER-IP"].append(_entry(fp.cluster_ip, p, port))
        ext = "KUBE-EXTERNAL-IP-LOCAL" if fp.external_policy_local else "KUBE-EXTERNAL-IP"
        sets[ext] += [_entry(ip, p, port) for ip in fp.external_ips]
        sets["KUBE-LOAD-BALANCER"] += [_entry(ip, p, port) for ip in fp.lb_ips]
        if fp.external_policy_local:
            sets["KUBE-LOAD-BALANCER-LOCAL"] += [_entry(ip, p, port) for ip in fp.lb_ips]
        if fp.firewalled:
            _firewall_entries(sets, fp, ss.node)
        if fp.sp.node_port and fp.sp.protocol in ("TCP", "UDP"):
            sets[f"KUBE-NODE-PORT-{fp.sp.protocol}"].append(str(fp.sp.node_port))
            if fp.external_policy_local:
                sets[f"KUBE-NODE-PORT-LOCAL-{fp.sp.protocol}"].append(str(fp.sp.node_port))
        sets["KUBE-LOOP-BACK"] += [f"{ep.ip},{p}:{ep.port},{ep.ip}" for ep in fp.reachable
                                   if ss.node.name and ep.node_name == ss.node.name]
    sets["KUBE-IPVS-IPS"] = [str(ip) for ip in dummy_addresses(ss, family)]
    return {k: sorted(set(v)) for k, v in sets.items()}


def _firewall_entries(sets: dict[str, list[str]], fp: FamilyPort, node: Node) -> None:
    """loadBalancerSourceRanges: each LB IP, each (LB IP, range), and (LB IP, LB IP) when a range
    holds the node's address (kube-proxy's allowFromNode)."""
    p, port = fp.proto, fp.sp.port
    for ip in fp.lb_ips:
        sets["KUBE-LOAD-BALANCER-FW"].append(_entry(ip, p, port))
        sets["KUBE-LOAD-BALANCER-SOURCE-CIDR"] += [f"{_entry(ip, p, port)},{net}"
                                                   for net in fp.source_ranges]
        if fp.allows_from_node(node):
            sets["KUBE-LOAD-BALANCER-SOURCE-IP"].append(f"{_entry(ip, p, port)},{ip}")


def set_name(name: str, family: Family) -> str:
    return name if family == 4 else name.replace("KUBE-", "KUBE-6-", 1)[:31]


def ipset_save(ss: ServiceSet, family: Family) -> str:
    """`ipset save` of the sets that have members (kube-proxy creates the others empty)."""
    inet = "inet" if family == 4 else "inet6"
    lines, empty = [], []
    for name, members in _set_entries(ss, family).items():
        real = set_name(name, family)
        if not members:
            empty.append(real)
            continue
        typ = "bitmap:port" if "NODE-PORT" in name else SET_TYPES.get(name, "hash:ip,port")
        header = "range 0-65535" if typ == "bitmap:port" else f"family {inet} hashsize 1024 maxelem 65536"
        lines.append(f"create {real} {typ} {header} comment")
        lines += [f"add {real} {m}" for m in members]
    if empty:
        lines.append("# empty: " + " ".join(empty))
    return "\n".join(lines) + "\n"


def _iptables(ss: ServiceSet, family: Family) -> Iterator[str]:
    """The nat-table helper rules of writeIptablesRules, for non-empty sets."""
    sets = _set_entries(ss, family)
    lo = "127.0.0.0/8" if family == 4 else "::1/128"
    mark = ss.node.masquerade_mark

    def n(name: str) -> str:
        return set_name(name, family)

    def c(name: str) -> str:
        return f'-m comment --comment "{SET_COMMENTS[name]}" -m set --match-set {n(name)}'

    yield f"-A KUBE-SERVICES -s {lo} -j RETURN"
    if sets["KUBE-LOOP-BACK"]:
        yield f"-A KUBE-POSTROUTING {c('KUBE-LOOP-BACK')} dst,dst,src -j MASQUERADE"
    if sets["KUBE-LOAD-BALANCER"]:
        yield f"-A KUBE-SERVICES {c('KUBE-LOAD-BALANCER')} dst,dst -j KUBE-LOAD-BALANCER"
    if sets["KUBE-LOAD-BALANCER-LOCAL"]:
        yield f"-A KUBE-LOAD-BALANCER {c('KUBE-LOAD-BALANCER-LOCAL')} dst,dst -j RETURN"
    for proto in ("TCP", "UDP"):
        if sets[f"KUBE-NODE-PORT-LOCAL-{proto}"]:
            yield f"-A KUBE-NODE-PORT -p {proto.lower()} {c(f'KUBE-NODE-PORT-LOCAL-{proto}')} dst -j RETURN"
        if sets[f"KUBE-NODE-PORT-{proto}"]:
            yield f"-A KUBE-NODE-PORT -p {proto.lower()} {c(f'KUBE-NODE-PORT-{proto}')} dst -j KUBE-MARK-MASQ"
    if sets["KUBE-CLUSTER-IP"]:
        cidr = ss.node.cluster_cidr(family)
        yield (f"-A KUBE-SERVICES {c('KUBE-CLUSTER-IP')} dst,dst ! -s {cidr} -j KUBE-MARK-MASQ"
               if cidr else f"-A KUBE-SERVICES {c('KUBE-CLUSTER-IP')} src,dst -j KUBE-MARK-MASQ")
    for name in ("KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL"):
        if sets[name]:
            if name == "KUBE-EXTERNAL-IP":
                yield f"-A KUBE-SERVICES {c(name)} dst,dst -j KUBE-MARK-MASQ"
            yield (f"-A KUBE-SERVICES {c(name)} dst,dst -m physdev ! --physdev-is-in "
                   "-m addrtype ! --src-type LOCAL -j ACCEPT")
            yield f"-A KUBE-SERVICES {c(name)} dst,dst -m addrtype --dst-type LOCAL -j ACCEPT"
    yield "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT"
    yield "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ"
    for name in ("KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER"):
        if sets[name]:
            yield f"-A KUBE-SERVICES -m set --match-set {n(name)} dst,dst -j ACCEPT"
    yield f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN"
    yield f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}"
    yield '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully'
    yield f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}"


def _firewall(ss: ServiceSet, family: Family) -> list[str]:
    """The filter table's source-range rules (writeIptablesRules), when some LB IP has ranges."""
    sets = _set_entries(ss, family)
    if not sets["KUBE-LOAD-BALANCER-FW"]:
        return []

    def rule(chain: str, name: str, match: str, target: str) -> str:
        return (f'-A {chain} -m comment --comment "{SET_COMMENTS[name]}" '
                f"-m set --match-set {set_name(name, family)} {match} -j {target}")

    lines = ["*filter", f":{PROXY_FIREWALL} - [0:0]", f":{SOURCE_RANGES_FIREWALL} - [0:0]",
             rule(PROXY_FIREWALL, "KUBE-LOAD-BALANCER-FW", "dst,dst", SOURCE_RANGES_FIREWALL)]
    lines += [rule(SOURCE_RANGES_FIREWALL, name, "dst,dst,src", "RETURN")
              for name in ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "KUBE-LOAD-BALANCER-SOURCE-IP") if sets[name]]
    return [*lines, f"-A {SOURCE_RANGES_FIREWALL} -j DROP", "COMMIT"]


def iptables_helpers(ss: ServiceSet, family: Family) -> str:
    """iptables-restore input: the nat helpers, then the filter source-range rules if any."""
    chains = ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ")
    lines = ["*nat", *(f":{ch} - [0:0]" for ch in chains), *_iptables(ss, family), "COMMIT",
             *_firewall(ss, family)]
    return "\n".join(lines) + "\n"


def _helpers_title(ss: ServiceSet, family: Family) -> str:
    return "nat helpers and the source-range filter" if _firewall(ss, family) else "nat helpers"


def render(ss: ServiceSet) -> str:
    parts = []
    for family in ss.families():
        vss = virtual_servers(ss, family)
        note = "" if ss.node.ips_of(family) else \
            "# (NodePort virtual servers exist per node address; pass --node-ip to list them)\n"
        parts.append(
            f"# ipvsadm -Ln   (IPv{family})\n{note}{ipvsadm(vss)}\n"
            f"# ip addr show {DUMMY}\n{ip_addr(dummy_addresses(ss, family))}\n"
            f"# ipset save\n{ipset_save(ss, family)}\n"
            f"# iptables-restore input ({_helpers_title(ss, family)} kube-proxy's IPVS mode still needs)\n"
            f"{iptables_helpers(ss, family)}")
    return "\n".join(parts) if parts else "# no Services with a ClusterIP\n"
