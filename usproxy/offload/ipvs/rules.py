"""What kube-proxy's IPVS mode installs for a set of ServicePorts, per IP family.

Follows kube-proxy pkg/proxy/ipvs/proxier.go syncProxyRules and writeIptablesRules:

- one virtual server per ClusterIP, externalIP, LoadBalancer IP and NodePort address (scheduler
  from the LB policy, `persistent <affinity timeout>` for ClientIP affinity), with Masq real
  servers of weight 1: Local policy uses this node's endpoints, or the Cluster policy's when there
  are none (syncEndpoint, kubernetes#97081);
- ClusterIPs, externalIPs and LoadBalancer IPs bound to the kube-ipvs0 dummy device (the last two
  only when they are not already the node's own addresses);
- the 17 ipsets of ipsetInfo (IPv6 names start KUBE-6-, cut to ipset's 31 characters), created
  always, empty or not, in kube-proxy's order;
- the iptables-restore input of writeIptablesRules: nat KUBE-SERVICES, KUBE-POSTROUTING,
  KUBE-NODE-PORT, KUBE-LOAD-BALANCER, KUBE-MARK-MASQ; filter KUBE-FORWARD, KUBE-NODE-PORT,
  KUBE-PROXY-FIREWALL, KUBE-SOURCE-RANGES-FIREWALL, KUBE-IPVS-FILTER, KUBE-IPVS-OUT-FILTER; and the
  entry jumps kube-proxy inserts outside that input (iptablesJumpChain).

One generator, two uses: `usproxy explain --mode ipvs` renders it (explain/ipvs.py) and the IPVS
datapath (datapath.py) installs it. A `Fragment` is one ServicePort's share (its virtual servers,
set entries and bound addresses); `Tables` sums fragments; the iptables text depends only on which
sets are empty, the node and the LoadBalancer IPs the node may not reach, so it is the same size
at 10 Services and at 10,000.

Where usproxy's rules differ from kube-proxy's (each stated where it is written): KUBE-IPVS-FILTER
lets through packets to a socket bound to the VIP itself (`-m socket --nowildcard`, before its
REJECT), because usproxy's relay listens on ClusterIP:port for the ServicePorts IPVS does not
serve (yet); kube-proxy's filter would refuse a new port of a Service during its offload window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from usproxy.model.endpoint import Endpoint
from usproxy.model.node import IPVS_DEVICE
from usproxy.model.service_port import LBPolicy
from usproxy.model.service_set import FamilyPort, Node
from usproxy.model.types import Family, IPAddress, ServicePortName
from usproxy.offload.iptables.jumps import Jump

DUMMY = IPVS_DEVICE
SERVICES, POSTROUTING, NODE_PORT = "KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT"
LOAD_BALANCER, MARK_MASQ, FORWARD = "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ", "KUBE-FORWARD"
PROXY_FIREWALL, SOURCE_RANGES_FIREWALL = "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL"
IPVS_FILTER, IPVS_OUT_FILTER = "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"
NAT_CHAINS = (SERVICES, POSTROUTING, NODE_PORT, LOAD_BALANCER, MARK_MASQ)  # iptablesChains, nat
FILTER_CHAINS = (FORWARD, NODE_PORT, PROXY_FIREWALL, SOURCE_RANGES_FIREWALL, IPVS_FILTER, IPVS_OUT_FILTER)
DEFAULT_SCHEDULER = "rr"
SCHEDULERS: dict[LBPolicy, str] = {"roundRobin": "rr", "leastConnections": "lc"}  # what IPVS serves
PERSISTENT = 0x0001  # IP_VS_SVC_F_PERSISTENT


@dataclass(frozen=True, slots=True)
class SetInfo:
    """One of kube-proxy's ipsets (ipsetInfo): its IPv4 name, type and comment."""

    name: str
    type: str
    comment: str

    def named(self, family: Family) -> str:
        return set_name(self.name, family)

    def header(self, family: Family) -> str:
        """The create line's options, as `ipset save` prints them (before bucketsize/initval)."""
        if self.type == "bitmap:port":
            return "range 0-65535"
        return f"family {'inet' if family == 4 else 'inet6'} hashsize 1024 maxelem 65536"


SETS: tuple[SetInfo, ...] = tuple(SetInfo(*s) for s in (
    ("KUBE-LOOP-BACK", "hash:ip,port,ip", "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
    ("KUBE-CLUSTER-IP", "hash:ip,port", "Kubernetes service cluster ip + port for masquerade purpose"),
    ("KUBE-EXTERNAL-IP", "hash:ip,port", "Kubernetes service external ip + port for masquerade and filter purpose"),
    ("KUBE-EXTERNAL-IP-LOCAL", "hash:ip,port",
     "Kubernetes service external ip + port with externalTrafficPolicy=local"),
    ("KUBE-LOAD-BALANCER", "hash:ip,port", "Kubernetes service lb portal"),
    ("KUBE-LOAD-BALANCER-FW", "hash:ip,port",
     "Kubernetes service load balancer ip + port for load balancer with sourceRange"),
    ("KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port",
     "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"),
    ("KUBE-LOAD-BALANCER-SOURCE-IP", "hash:ip,port,ip",
     "Kubernetes service load balancer ip + port + source IP for packet filter purpose"),
    ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "hash:ip,port,net",
     "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"),
    ("KUBE-NODE-PORT-TCP", "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "bitmap:port", "Kubernetes nodeport TCP port with externalTrafficPolicy=local"),
    ("KUBE-NODE-PORT-UDP", "bitmap:port", "Kubernetes nodeport UDP port for masquerade purpose"),
    ("KUBE-NODE-PORT-LOCAL-UDP", "bitmap:port", "Kubernetes nodeport UDP port with externalTrafficPolicy=local"),
    ("KUBE-NODE-PORT-SCTP-HASH", "hash:ip,port",
     "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"),
    ("KUBE-NODE-PORT-LOCAL-SCTP-HASH", "hash:ip,port",
     "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"),
    ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port", "Kubernetes health check node port"),
    ("KUBE-IPVS-IPS", "hash:ip", "Addresses on the ipvs interface"),
))
SET_BY_NAME = {s.name: s for s in SETS}


@dataclass(frozen=True, slots=True)
class SetRule:
    """One rule of ipsetWithIptablesChain: `-A <chain> [-p proto] <comment> --match-set <set> <match> -j <to>`."""

    set: str
    table: str
    chain: str
    target: str
    match: str
    proto: str = ""


SET_RULES: tuple[SetRule, ...] = (  # kube-proxy's order: the Local sets before theirs
    SetRule("KUBE-LOOP-BACK", "nat", POSTROUTING, "MASQUERADE", "dst,dst,src"),
    SetRule("KUBE-LOAD-BALANCER", "nat", SERVICES, LOAD_BALANCER, "dst,dst"),
    SetRule("KUBE-LOAD-BALANCER-LOCAL", "nat", LOAD_BALANCER, "RETURN", "dst,dst"),
    SetRule("KUBE-NODE-PORT-LOCAL-TCP", "nat", NODE_PORT, "RETURN", "dst", "tcp"),
    SetRule("KUBE-NODE-PORT-TCP", "nat", NODE_PORT, MARK_MASQ, "dst", "tcp"),
    SetRule("KUBE-NODE-PORT-LOCAL-UDP", "nat", NODE_PORT, "RETURN", "dst", "udp"),
    SetRule("KUBE-NODE-PORT-UDP", "nat", NODE_PORT, MARK_MASQ, "dst", "udp"),
    SetRule("KUBE-NODE-PORT-LOCAL-SCTP-HASH", "nat", NODE_PORT, "RETURN", "dst,dst", "sctp"),
    SetRule("KUBE-NODE-PORT-SCTP-HASH", "nat", NODE_PORT, MARK_MASQ, "dst,dst", "sctp"),
    SetRule("KUBE-LOAD-BALANCER-FW", "filter", PROXY_FIREWALL, SOURCE_RANGES_FIREWALL, "dst,dst"),
    SetRule("KUBE-LOAD-BALANCER-SOURCE-CIDR", "filter", SOURCE_RANGES_FIREWALL, "RETURN", "dst,dst,src"),
    SetRule("KUBE-LOAD-BALANCER-SOURCE-IP", "filter", SOURCE_RANGES_FIREWALL, "RETURN", "dst,dst,src"),
)

PORTALS = "kubernetes service portals"
FIREWALL = "kube-proxy firewall rules"
ACCESS_FILTER = "kubernetes ipvs access filter"
# iptablesJumpChain, in the order kube-proxy ensures them (each `iptables -I <base> 1`).
JUMPS: tuple[Jump, ...] = (
    Jump("nat", "OUTPUT", SERVICES, PORTALS, False),
    Jump("nat", "PREROUTING", SERVICES, PORTALS, False),
    Jump("nat", "POSTROUTING", POSTROUTING, "kubernetes postrouting rules", False),
    Jump("filter", "FORWARD", FORWARD, "kubernetes forwarding rules", False),
    Jump("filter", "INPUT", NODE_PORT, "kubernetes health check rules", False),
    Jump("filter", "INPUT", PROXY_FIREWALL, FIREWALL, False),
    Jump("filter", "FORWARD", PROXY_FIREWALL, FIREWALL, False),
    Jump("filter", "INPUT", IPVS_FILTER, ACCESS_FILTER, False),
    Jump("filter", "OUTPUT", IPVS_OUT_FILTER, ACCESS_FILTER, False),
)

VsKey = tuple[str, IPAddress, int]  # (PROTO, address, port): one IPVS service


def set_name(name: str, family: Family) -> str:
    """kube-proxy's NewIPSet: IPv6 sets are KUBE-6-..., cut to ipset's 31 characters."""
    return name if family == 4 else name.replace("KUBE-", "KUBE-6-", 1)[:31]


def scheduler(policy: LBPolicy | None) -> str:
    """The IPVS scheduler of an LB policy (rr when IPVS has none: explain renders it so; the
    datapath's declaration lists only the policies of SCHEDULERS)."""
    return SCHEDULERS.get(policy, DEFAULT_SCHEDULER) if policy is not None else DEFAULT_SCHEDULER


@dataclass(frozen=True, slots=True)
class VirtualServer:
    """One IPVS service and its real servers (Masq, weight 1)."""

    proto: str  # "TCP", "UDP", "SCTP"
    address: IPAddress
    port: int
    scheduler: str
    persistent: int | None  # the persistence timeout (ClientIP affinity), None: not persistent
    reals: tuple[Endpoint, ...]
    spn: ServicePortName
    kind: str  # "cluster IP", "external IP", "loadbalancer IP", "node port"

    @property
    def key(self) -> VsKey:
        return (self.proto, self.address, self.port)

    def sort_key(self) -> tuple[str, int, bytes, int]:
        return (self.proto, self.address.version, self.address.packed, self.port)


@dataclass(frozen=True, slots=True)
class Fragment:
    """One ServicePort's share of one family's IPVS state."""

    spn: ServicePortName
    servers: tuple[VirtualServer, ...]
    entries: tuple[tuple[str, str], ...]  # (set, entry) pairs, set by its IPv4 name
    bound: tuple[IPAddress, ...]  # addresses for kube-ipvs0
    no_node_access: tuple[tuple[IPAddress, str, int], ...]  # LB IPs the node may not reach


def _reals(fp: FamilyPort, local_only: bool) -> tuple[Endpoint, ...]:
    """syncEndpoint: Local policy uses local endpoints, or the cluster-wide ones if there are none."""
    if local_only and fp.local:
        return fp.local
    return fp.cluster if fp.uses_cluster_endpoints else fp.local


def _entry(ip: IPAddress, proto: str, port: int) -> str:
    return f"{ip},{proto}:{port}"


def fragment(fp: FamilyPort, node: Node, node_ips: Sequence[IPAddress],
             default_policy: LBPolicy | None = None) -> Fragment:
    """One ServicePort as kube-proxy's `family` proxier installs it. `node_ips`: the node's
    addresses of this family where NodePorts are served (and that are never bound to kube-ipvs0)."""
    sp, p, port = fp.sp, fp.proto, fp.sp.port
    persistent = sp.affinity_timeout if sp.session_affinity == "ClientIP" else None
    sched = scheduler(sp.lb_policy or default_policy)

    def vs(addr: IPAddress, at: int, local: bool, kind: str) -> VirtualServer:
        reals = tuple(sorted(_reals(fp, local), key=Endpoint.sort_key))  # (family, address, port): the packed order
        return VirtualServer(sp.protocol, addr, at, sched, persistent, reals, sp.name, kind)

    servers = [vs(fp.cluster_ip, port, fp.internal_policy_local, "cluster IP")]
    entries = [("KUBE-CLUSTER-IP", _entry(fp.cluster_ip, p, port))]
    bound = [fp.cluster_ip]
    entries += [("KUBE-LOOP-BACK", f"{ep.ip},{p}:{ep.port},{ep.ip}") for ep in fp.endpoints
                if node.name and ep.node_name == node.name]
    ext_set = "KUBE-EXTERNAL-IP-LOCAL" if fp.external_policy_local else "KUBE-EXTERNAL-IP"
    for ip in fp.external_ips:
        entries.append((ext_set, _entry(ip, p, port)))
        servers.append(vs(ip, port, fp.external_policy_local, "external IP"))
        bound += [ip] if ip not in node_ips else []
    no_access = []
    for ip in fp.lb_ips:
        entries.append(("KUBE-LOAD-BALANCER", _entry(ip, p, port)))
        if fp.external_policy_local:
            entries.append(("KUBE-LOAD-BALANCER-LOCAL", _entry(ip, p, port)))
        if fp.source_ranges:
            entries.append(("KUBE-LOAD-BALANCER-FW", _entry(ip, p, port)))
            entries += [("KUBE-LOAD-BALANCER-SOURCE-CIDR", f"{_entry(ip, p, port)},{net}") for net in fp.source_ranges]
            if fp.allows_from_node(node):
                entries.append(("KUBE-LOAD-BALANCER-SOURCE-IP", f"{_entry(ip, p, port)},{ip}"))
            else:
                no_access.append((ip, p, port))
        servers.append(vs(ip, port, fp.external_policy_local, "loadbalancer IP"))
        bound += [ip] if ip not in node_ips else []
    if sp.node_port:
        entries += _nodeport_entries(fp, node_ips)
        servers += [vs(ip, sp.node_port, fp.external_policy_local, "node port") for ip in node_ips]
    if sp.health_check_node_port:
        entries.append(("KUBE-HEALTH-CHECK-NODE-PORT", str(sp.health_check_node_port)))
    entries += [("KUBE-IPVS-IPS", str(ip)) for ip in bound]  # activeBindAddrs
    return Fragment(sp.name, tuple(servers), tuple(entries), tuple(bound), tuple(no_access))


def _nodeport_entries(fp: FamilyPort, node_ips: Sequence[IPAddress]) -> list[tuple[str, str]]:
    proto, port, local = fp.sp.protocol, fp.sp.node_port, fp.external_policy_local
    if proto == "SCTP":  # hash:ip,port with every node address
        names = ["KUBE-NODE-PORT-SCTP-HASH", *(["KUBE-NODE-PORT-LOCAL-SCTP-HASH"] if local else [])]
        return [(n, _entry(ip, "sctp", port)) for n in names for ip in node_ips]
    names = [f"KUBE-NODE-PORT-{proto}", *([f"KUBE-NODE-PORT-LOCAL-{proto}"] if local else [])]
    return [(n, str(port)) for n in names]


@dataclass
class Tables:
    """One family's IPVS state summed over fragments: what the kernel should hold."""

    family: Family
    node: Node
    fragments: dict[ServicePortName, Fragment] = field(default_factory=dict)
    entries: dict[str, Counter[str]] = field(default_factory=lambda: {s.name: Counter() for s in SETS})
    bound: Counter[IPAddress] = field(default_factory=Counter)
    no_node_access: Counter[tuple[IPAddress, str, int]] = field(default_factory=Counter)
    claims: dict[VsKey, frozenset[ServicePortName]] = field(default_factory=dict)  # the fragments naming each virtual server (frozen: a copy of Tables shares them)

    def put(self, frag: Fragment | None, spn: ServicePortName) -> None:
        """Replace `spn`'s fragment (None: remove it)."""
        old = self.fragments.pop(spn, None)
        if old is not None:
            self._count(old, -1)
            self._claim(old, spn, False)
        if frag is not None:
            self.fragments[spn] = frag
            self._count(frag, 1)
            self._claim(frag, spn, True)

    def _claim(self, frag: Fragment, spn: ServicePortName, on: bool) -> None:
        for vs in frag.servers:
            names = self.claims.get(vs.key, frozenset())
            names = names | {spn} if on else names - {spn}
            if names:
                self.claims[vs.key] = names
            else:
                self.claims.pop(vs.key, None)

    def server(self, key: VsKey) -> VirtualServer | None:
        """The virtual server of `key` as `servers()` has it, found through `claims`."""
        names = self.claims.get(key)
        if not names:
            return None
        return next(vs for vs in self.fragments[min(names)].servers if vs.key == key)

    def _count(self, frag: Fragment, n: int) -> None:
        for name, entry in frag.entries:
            self.entries[name][entry] += n
            if self.entries[name][entry] <= 0:
                del self.entries[name][entry]
        for ip in frag.bound:
            self.bound[ip] += n
            if self.bound[ip] <= 0:
                del self.bound[ip]
        for e in frag.no_node_access:
            self.no_node_access[e] += n
            if self.no_node_access[e] <= 0:
                del self.no_node_access[e]

    def servers(self) -> dict[VsKey, VirtualServer]:
        """Every virtual server; one key claimed twice (two Services on one address and port,
        which the API server forbids) keeps the first ServicePort's by name."""
        out: dict[VsKey, VirtualServer] = {}
        for spn in sorted(self.fragments):
            for vs in self.fragments[spn].servers:
                out.setdefault(vs.key, vs)
        return out

    def set_members(self, name: str) -> list[str]:
        return sorted(self.entries[name])

    def bound_addresses(self) -> list[IPAddress]:
        return sorted(self.bound, key=lambda ip: ip.packed)

    def restore_input(self, random_fully: bool = True) -> str:
        return restore_input(self.family, self.node, lambda name: bool(self.entries[name]),
                             sorted(self.no_node_access, key=lambda e: (e[0].packed, e[1], e[2])), random_fully)


def tables(fps: Iterable[FamilyPort], node: Node, family: Family, node_ips: Sequence[IPAddress],
           default_policy: LBPolicy | None = None) -> Tables:
    t = Tables(family, node)
    for fp in fps:
        t.put(fragment(fp, node, node_ips, default_policy), fp.name)
    return t


def restore_input(family: Family, node: Node, has: Callable[[str], bool], no_node_access: Sequence[tuple[IPAddress, str, int]],
                  random_fully: bool = True) -> str:
    """writeIptablesRules: the iptables-restore input for one family. `has(set)` says whether a
    set (IPv4 name) has members."""
    nat, filt = list(_nat_rules(family, node, has, random_fully)), list(_filter_rules(family, has, no_node_access, node))
    return "\n".join(["*nat", *(f":{c} - [0:0]" for c in NAT_CHAINS), *nat, "COMMIT",
                      "*filter", *(f":{c} - [0:0]" for c in FILTER_CHAINS), *filt, "COMMIT"]) + "\n"


def _mark(node: Node) -> str:
    """The masquerade mark as the IPVS proxier formats it ("%#08x": 0x004000)."""
    return f"{int(node.masquerade_mark, 16):#08x}"


def _match_set(name: str, family: Family) -> str:
    return f'-m comment --comment "{SET_BY_NAME[name].comment}" -m set --match-set {set_name(name, family)}'


def _set_rules(table: str, family: Family, has: Callable[[str], bool]) -> Iterator[str]:
    for r in SET_RULES:
        if r.table == table and has(r.set):
            proto = f"-p {r.proto} " if r.proto else ""
            yield f"-A {r.chain} {proto}{_match_set(r.set, family)} {r.match} -j {r.target}"


def _nat_rules(family: Family, node: Node, has: Callable[[str], bool], random_fully: bool) -> Iterator[str]:
    mark = _mark(node)
    yield f"-A {SERVICES} -s {'127.0.0.0/8' if family == 4 else '::1/128'} -j RETURN"
    yield from _set_rules("nat", family, has)
    if has("KUBE-CLUSTER-IP"):
        match = node.local_match(family)
        head = f"-A {SERVICES} {_match_set('KUBE-CLUSTER-IP', family)}"
        if node.masquerade_all:
            yield f"{head} dst,dst -j {MARK_MASQ}"
        elif match is not None:
            yield f"{head} dst,dst ! {match[0]} {match[1]} -j {MARK_MASQ}"
        else:  # the VIP is the source the node picks to reach a VIP bound on kube-ipvs0
            yield f"{head} src,dst -j {MARK_MASQ}"
    for name in ("KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL"):
        if has(name):
            head = f"-A {SERVICES} {_match_set(name, family)} dst,dst"
            if name == "KUBE-EXTERNAL-IP":
                yield f"{head} -j {MARK_MASQ}"
            yield f"{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"
            yield f"{head} -m addrtype --dst-type LOCAL -j ACCEPT"
    yield f"-A {SERVICES} -m addrtype --dst-type LOCAL -j {NODE_PORT}"
    yield f"-A {LOAD_BALANCER} -j {MARK_MASQ}"
    for name in ("KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER"):  # acceptIPVSTraffic
        if has(name):
            yield f"-A {SERVICES} -m set --match-set {set_name(name, family)} dst,dst -j ACCEPT"
    yield f"-A {POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN"
    yield f"-A {POSTROUTING} -j MARK --xor-mark {mark}"
    yield (f'-A {POSTROUTING} -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE'
           + (" --random-fully" if random_fully else ""))
    yield f"-A {MARK_MASQ} -j MARK --or-mark {mark}"


def _filter_rules(family: Family, has: Callable[[str], bool], no_node_access: Sequence[tuple[IPAddress, str, int]],
                  node: Node) -> Iterator[str]:
    mark = _mark(node)
    yield from _set_rules("filter", family, has)
    yield f"-A {SOURCE_RANGES_FIREWALL} -j DROP"
    for ip, proto, port in no_node_access:  # for IPVS the source and destination are both the LB IP
        yield f"-A {IPVS_OUT_FILTER} -s {ip} -m ipvs --vaddr {ip} --vproto {proto} --vport {port} -j DROP"
    yield f'-A {FORWARD} -m comment --comment "kubernetes forwarding rules" -m mark --mark {mark}/{mark} -j ACCEPT'
    yield (f'-A {FORWARD} -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack '
           "--ctstate RELATED,ESTABLISHED -j ACCEPT")
    hc = set_name("KUBE-HEALTH-CHECK-NODE-PORT", family)
    yield f"-A {NODE_PORT} {_match_set('KUBE-HEALTH-CHECK-NODE-PORT', family)} dst -j ACCEPT"
    for name in ("KUBE-LOAD-BALANCER", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL"):
        yield f"-A {IPVS_FILTER} -m set --match-set {set_name(name, family)} dst,dst -j RETURN"
    yield f"-A {IPVS_FILTER} -m set --match-set {hc} dst -j RETURN"
    # usproxy: the relay's sockets bound to a VIP (module docstring); host ports on 0.0.0.0 stay refused
    yield f'-A {IPVS_FILTER} -m comment --comment "usproxy: sockets bound to a VIP (the relay)" -m socket --nowildcard -j RETURN'
    yield (f"-A {IPVS_FILTER} -m conntrack --ctstate NEW -m set --match-set {set_name('KUBE-IPVS-IPS', family)} "
           "dst -j REJECT")


def ipset_save(t: Tables) -> str:
    """`ipset save` of one family's sets, as kube-proxy leaves them: every set, in kube-proxy's
    order, members sorted (the kernel lists them in hash order; readers compare sorted)."""
    lines = []
    for s in SETS:
        name = s.named(t.family)
        lines.append(f"create {name} {s.type} {s.header(t.family)}")
        lines += [f"add {name} {m}" for m in t.set_members(s.name)]
    return "\n".join(lines) + "\n"


def listed_jumps() -> list[Jump]:
    """The entry jumps in the order `iptables-save` shows them (each insert goes to the top)."""
    out: list[Jump] = []
    for table, bases in (("filter", ("INPUT", "FORWARD", "OUTPUT")), ("nat", ("PREROUTING", "INPUT", "OUTPUT",
                                                                            "POSTROUTING"))):
        for base in bases:
            out += reversed([j for j in JUMPS if j.table == table and j.base == base])
    return out


def render_jumps() -> str:
    lines = []
    for table in ("filter", "nat"):
        rules = [j.text() for j in listed_jumps() if j.table == table]
        lines += [f"*{table}", *rules, "COMMIT"]
    return "\n".join(lines) + "\n"
