"""`usproxy explain trace SRC DST:PORT[/PROTO]`: the path one new connection takes in each mode.

One tracer per mode, each over the text that mode's view prints, as kube-proxy's tests trace their
own dumps: iptables over the iptables-restore input (`iptables_trace`), nftables over the
transaction dump (`nftables_trace`, quoting each rule as the view's `nft list` prints it), IPVS over its nat helper rules, `ipset save`, `ip addr show
kube-ipvs0` and `ipvsadm -Ln`, BPF over `cilium-dbg bpf lb list`, userspace over kube-proxy 1.0's
portal rules. So a trace can only follow, and only count, rules that are really printed. Each
path ends with what follows the first packet (`reply`): conntrack or its equivalent, where
masquerade happens, the source the backend sees and how the reply is un-NATed.

A random choice (`-m statistic`, `numgen`, IPVS rr, a BPF slot) splits the walk: every branch is
followed and reported with its exact share (fractions.Fraction). A new client has no affinity
entry yet, so `-m recent --rcheck` and `@affinity-*` lookups do not match. Counts: `rules` are the
rendered rules evaluated for the first packet, `lookups` hash-map/set lookups (nftables sets and
maps, ipsets, the IPVS service table, BPF maps). Counting stops at the verdict that decides where
the connection lands (DNAT); filter checks after DNAT are not walked.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from usproxy.explain import bpf, nftables, tc_trace, trace_story, userspace
from usproxy.offload.iptables import rules as iptables
from usproxy.offload.iptables import jumps as iptables_entry
from usproxy.explain.iptables_trace import Walker, parse_restore
from usproxy.explain.ipvs_trace import trace_ipvs
from usproxy.explain.mode import NO_OPTIONS, Mode, TraceOptions
from usproxy.explain.nftables_trace import Walker as NftWalker
from usproxy.explain.nftables_trace import parse_dump
from usproxy.explain.packet import Packet, Path, parse_packet
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.explain.userspace import proxy_port
from usproxy.model.source_ranges import allowed_sources, allows
from usproxy.model.types import format_hostport

__all__ = ["Packet", "Path", "parse_packet", "render", "trace_bpf", "trace_iptables",
           "trace_ipvs", "trace_nftables", "trace_userspace"]


def _refused(pkt: Packet) -> str:
    return "TCP RST" if pkt.proto == "TCP" else "ICMP port unreachable"


# --- iptables, nftables --------------------------------------------------------------------

def trace_iptables(ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]:
    """From the built-in chains the view's entry jumps leave (iptables_entry): nat PREROUTING (or
    OUTPUT from this node), then, for a packet nat left untranslated, filter FORWARD (or INPUT to
    this node, OUTPUT from it), then nat POSTROUTING where KUBE-POSTROUTING masquerades; the
    kernel's own order, as kube-proxy's iptablesTracer (pkg/proxy/iptables/proxier_test.go)."""
    rs = iptables.build(ss, pkt.dst.version)
    w = Walker(parse_restore(iptables.render_ruleset(rs) + iptables_entry.render(rs.chains)), pkt)
    out = []
    for p in w.walk("nat", "OUTPUT" if pkt.src_local else "PREROUTING", Path()):
        for chain in _filter_chains(pkt):  # a DNATed packet is not walked here (see the docstring)
            if not p.result:
                p = w.walk("filter", chain, p)[0]  # filter rules carry no probability: one path
        if p.result == "ACCEPT" and not p.lands:  # a filter ACCEPT, as kube-proxy's tracer reports it
            p.result = "ACCEPT: delivered to the local listener (the health check server)"
            p.lands = "ACCEPT"
        p.result = p.result or "no Service rule matched: routed as addressed"
        if p.lands not in ("REJECT", "DROP", "ERROR"):
            masquerade = p.masquerade  # KUBE-POSTROUTING clears the mark it acts on; the flow stays masqueraded
            p = w.walk("nat", "POSTROUTING", p)[0]
            p.masquerade = masquerade
        out.append(p)
    return out


def _filter_chains(pkt: Packet) -> tuple[str, ...]:
    """The filter table's built-in chains a packet that keeps its destination crosses."""
    if pkt.src_local:
        return ("OUTPUT", "INPUT") if pkt.dst_local else ("OUTPUT",)
    return ("INPUT",) if pkt.dst_local else ("FORWARD",)


def trace_nftables(ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]:
    """The hooked base chains in priority order: filter pre-dnat, nat, then filter (not DNATed),
    then nat postrouting."""
    t = nftables.build(ss, pkt.dst.version)
    w = NftWalker(parse_dump(nftables.dump(t)), pkt, nftables.listed_rules(t, ss.node.masquerade_mark))
    hook = "output" if pkt.src_local else "prerouting"
    after = "filter-output" if pkt.src_local else (
        "filter-input" if pkt.dst_local else "filter-forward")
    paths = [Path()]
    for base in (f"filter-{hook}-pre-dnat", f"nat-{hook}", after):
        nxt: list[Path] = []
        for p in paths:
            if p.result:
                nxt.append(p)
                continue
            ended, through = w.walk(base, p)
            nxt += ended + through
        paths = nxt
        if base.startswith("nat") and all(p.result for p in paths):
            break
    for p in paths:
        p.result = p.result or "no Service element matched: routed as addressed"
    return [_nft_postrouting(w, p) for p in paths]


def _nft_postrouting(w: NftWalker, p: Path) -> Path:
    """The nat postrouting base chain, where `masquerading` acts on the mark, as in iptables."""
    if p.lands in ("REJECT", "DROP", "ERROR") or "nat-postrouting" not in w.dump.chains:
        return p
    masquerade = p.masquerade  # the chain clears the mark it acts on; the flow stays masqueraded
    ended, through = w.walk("nat-postrouting", p)
    (out,) = ended + through
    out.masquerade = masquerade
    return out


# --- bpf -----------------------------------------------------------------------------------

def _lb_rows(text: str) -> dict[str, dict[int, tuple[str, str]]]:
    """`cilium-dbg bpf lb list` -> {frontend: {slot: (backend or "", line)}}."""
    out: dict[str, dict[int, tuple[str, str]]] = {}
    for line in text.splitlines()[1:]:
        key, slot_text, value = line.split()[:3]
        slot = int(slot_text.strip("()"))
        out.setdefault(key, {})[slot] = (value.rpartition("/")[0] if slot else "", line)
    return out


def _local_process(ss: ServiceSet, pkt: Packet) -> bool:
    """The node itself, or a pod here: one the input places on this node (`pkt.src_pod`), or an
    address in --cluster-cidr, taken to run on this node."""
    return pkt.src_local or bool(_pod_here(ss, pkt))


def _pod_here(ss: ServiceSet, pkt: Packet) -> str:
    """Why SRC is taken as a pod on this node, in a phrase; "" when it is not."""
    if pkt.src_pod:
        return pkt.src_pod
    cidr = ss.node.cluster_cidr(pkt.src.version)
    return "in --cluster-cidr" if cidr is not None and pkt.src in cidr else ""


def trace_bpf(ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]:
    """Socket LB for this node's processes connecting to a ClusterIP (connect() rewritten, no
    per-packet NAT). NodePorts, LB IPs and externalIPs are tc-only frontends (F_TC_ONLY,
    usproxy/offload/bpf/datapath.py `_wants`): a packet from elsewhere or from a pod here meets
    usproxy's tc program (tc_trace, `opts.bpf_lb_mode` as --bpf-lb-mode); the node's own
    connection, which no tc ingress sees, and what tc passes to the stack untouched (IPv6, SCTP, no
    tc frontend) go to usproxy's fallback."""
    lb_mode = opts.bpf_lb_mode
    if not _local_process(ss, pkt):
        served = tc_trace.trace(ss, pkt, lb_mode)
        if isinstance(served, str):
            return _bpf_fallback(ss, pkt, [BPF_ELSEWHERE, f"tc ingress: {served}"])
        return [_elsewhere(p) for p in served]
    external = _tc_only_frontend(ss, pkt)
    if external is not None:
        return _local_to_tc_only(ss, pkt, external, lb_mode)
    fes = [fe for fe in bpf.frontends(ss) if fe.type == "ClusterIP"]
    rows = _lb_rows(bpf.lb_list(fes))
    policies = {fe.text(): fe.fp.sp.lb_policy for fe in fes}
    key = f"{format_hostport(pkt.dst, pkt.dport)}/{pkt.proto}"
    p = Path()
    if not pkt.src_local:
        p.note(BPF_POD_HERE.format(src=pkt.src, why=_pod_here(ss, pkt)))
    p.lookups += 1
    if key in rows:
        return _slots(p, rows[key], _selection_text(policies.get(key)))
    p.result = "no frontend in the services map: connect() goes to the address as given"
    return [p]


BPF_POD_HERE = (
    "socket LB: {src} is a pod on this node ({why}), inside the BPF cgroup: the socket LB "
    "rewrites its connect() to a ClusterIP before any packet exists (a pod on another node is "
    "served by its own node's proxy)")
BPF_TC_ONLY = (
    "socket LB: not on this path: {dst} is a {type} frontend, flagged tc-only (F_TC_ONLY); "
    "usproxy's socket LB rewrites connect() to ClusterIPs only (usproxy/offload/bpf/datapath.py "
    "`_wants`), so the connection leaves with {dst} as its destination (Cilium's socket LB also "
    "rewrites connect() to NodePorts, LB IPs and externalIPs; usproxy's does not)")
BPF_POD_BRIDGE = (
    "pod bridge: {src} is a pod on this node ({why}): its packet leaves "
    "the pod by its veth into the pod bridge, a hooked interface (it holds a node address; with "
    "--nodeport-addresses, only when one of its addresses is inside them), so usp_tc_ingress there "
    "serves it as a packet from outside")
BPF_POD_LOCAL = (
    "externalTrafficPolicy Local holds for a pod here too: tc sends it to this node's endpoints "
    "only (kube-proxy short-circuits pod traffic to every endpoint)")
BPF_NODE_NO_TC = (
    "tc: not on this path: {src} is this node, and no usp_tc_ingress sees a packet the node sends "
    "(tc ingress runs on the interfaces holding node addresses and the pod bridge; a packet to a "
    "node address goes through lo, never hooked, and usp_tc_egress only reverse-NATs replies)")


def _tc_only_frontend(ss: ServiceSet, pkt: Packet) -> bpf.Frontend | None:
    """The NodePort (at a node address), LB IP or externalIP frontend `pkt` is addressed to."""
    return next((fe for fe in bpf.frontends(ss) if fe.type in bpf.TC_TYPES and fe.address == pkt.dst
                 and fe.port == pkt.dport and fe.proto == pkt.proto), None)


def _local_to_tc_only(ss: ServiceSet, pkt: Packet, fe: bpf.Frontend, lb_mode: str) -> list[Path]:
    """A pod here: its packet meets tc on the pod bridge; the node itself: the fallback."""
    head = BPF_TC_ONLY.format(dst=format_hostport(pkt.dst, pkt.dport), type=fe.type)
    if pkt.src_local:
        return _bpf_fallback(ss, pkt, [head, BPF_NODE_NO_TC.format(src=pkt.src)])
    pod = [head, BPF_POD_BRIDGE.format(src=pkt.src, why=_pod_here(ss, pkt))]
    served = tc_trace.trace(ss, pkt, lb_mode)
    if isinstance(served, str):
        return _bpf_fallback(ss, pkt, [*pod, f"tc ingress: {served}"])
    local = [BPF_POD_LOCAL] if fe.fp.external_policy_local else []
    for p in served:
        p.hops = [*pod, *p.hops[:1], *local, *p.hops[1:]]
    return served


def _selection_text(policy: str | None) -> str:
    """How the agent's socket LB picks a slot (usproxy/offload/bpf/datapath.py `_flags`): the
    Service's usproxy.io/lb-policy, else the agent's --lb-policy, roundRobin unless set
    (explain cannot know the flag of a running agent)."""
    if policy == "random":
        return "slot chosen at random (usproxy.io/lb-policy random)"
    if policy == "leastConnections":  # the agent leaves such a Service to its relay
        return ("slot chosen at random, as Cilium's socket LB (usproxy's leaves leastConnections "
                "Services to its relay)")
    if policy == "roundRobin":
        return "slot by round robin, a counter per ServicePort (usproxy.io/lb-policy roundRobin)"
    return ("slot by round robin, a counter per ServicePort (the agent's default --lb-policy "
            "roundRobin; with --lb-policy random, or in Cilium, at random)")


def _slots(p: Path, slots: dict[int, tuple[str, str]], selection: str) -> list[Path]:
    p.note(f"connect() hook, services map: {slots[0][1]}")
    backends = [slots[s] for s in sorted(slots) if s > 0]
    if not backends:
        p.result, p.lands = "no backends: connect() fails at once (ECONNREFUSED)", "REJECT"
        return [p]
    out = []
    for backend, line in backends:
        q = p.fork(Fraction(1, len(backends)))
        q.lookups += 2  # the chosen slot, then the backends map
        q.note(f"{selection}, 1/{len(backends)}: {line}")
        q.result = (f"to {backend} (connect() rewrote the socket's destination: no packet is "
                    "translated, no source NAT)")
        q.lands = backend
        out.append(q)
    return out


BPF_ELSEWHERE = (
    "socket LB: not on this path: it rewrites connect() of processes on this node inside the BPF "
    "cgroup (a pod here connecting to a ClusterIP would be served at connect(), no packet "
    "translated); SRC is not a --node-ip, not in --cluster-cidr and not a pod the input places "
    "on this node, so this is traced as a packet arriving from elsewhere")


def _elsewhere(p: Path) -> Path:
    p.hops = [BPF_ELSEWHERE, *p.hops]
    return p


def _bpf_fallback(ss: ServiceSet, pkt: Packet, why: list[str]) -> list[Path]:
    """What tc passes to the stack, or never sees, goes to usproxy's nftables datapath, or the
    relay where nftables is unavailable (README "Kernel offload": "What tc passes goes to the
    relay"); `why` are the hops that say how the packet got there."""
    paths = trace_nftables(ss, pkt)
    for p in paths:
        p.hops = [*why,
                  "served on this node by usproxy's fallback: its nftables datapath (traced below "
                  "with the nftables view's rules), or the relay where nftables is unavailable",
                  *(f"nftables: {h}" for h in p.hops)]
        p.result = f"nftables fallback: {p.result}"
    return paths


# --- userspace -----------------------------------------------------------------------------

def trace_userspace(ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]:
    """kube-proxy 1.0's portal rules (IPv4), then what usproxy's relay does with the same packet."""
    p = Path()
    if pkt.dst.version == 4:
        _portals(ss, pkt, p)
    return _relay(ss, pkt, p)


def _portals(ss: ServiceSet, pkt: Packet, p: Path) -> None:
    """PREROUTING (from elsewhere: REDIRECT) or OUTPUT (from this node: DNAT to the node IP),
    then what 1.0's proxy did on its port: with no endpoint it still accepted (TCP) or read (UDP),
    found none and closed the connection or dropped the datagram (pkg/proxy/userspace
    proxysocket.go: tryConnect fails, inConn.Close())."""
    w = Walker(parse_restore(userspace.portal_rules(ss)), pkt)
    entry = "OUTPUT" if pkt.src_local else "PREROUTING"
    q = w.walk("nat", entry, p)[0]  # portal rules carry no probability: one path, p itself
    q.hops = [f"kube-proxy 1.0: {h}" for h in q.hops]
    if q.result:
        port = int(q.result.rpartition(":" if q.result.startswith("DNAT") else " ")[2])
        fp = next(fp for fp in ss.family_ports(4) if proxy_port(fp) == port)
        q.note(f"kube-proxy 1.0: {q.result}: {_legacy_proxy(fp, pkt)}")
        if not fp.cluster:
            q.aside = ("kube-proxy 1.0 accepted it, then closed it (no endpoint)" if pkt.proto == "TCP"
                       else "kube-proxy 1.0 read the datagram and dropped it (no endpoint)")
    else:
        q.note("kube-proxy 1.0: no portal rule matched")
    q.result, q.lands = "", ""


def _legacy_proxy(fp: FamilyPort, pkt: Packet) -> str:
    """What kube-proxy 1.0's proxy did with the connection its portal rule sent it."""
    if fp.cluster:
        which = (f"one of {len(fp.cluster)} endpoints (round robin)" if len(fp.cluster) > 1
                 else "its endpoint")
        if pkt.proto == "TCP":
            return f"its proxy accepts there and opens a second connection to {which}"
        return f"its proxy reads the datagram there and sends it on from a socket of its own to {which}"
    if pkt.proto == "TCP":
        return ("its proxy accepts there, finds no endpoint and closes the connection: the client "
                "sees it open, then close at once")
    return "its proxy reads the datagram there, finds no endpoint and drops it: no answer"


def _nodeport_listener(ss: ServiceSet, pkt: Packet) -> bool:
    """The relay listens on NodePorts at the node addresses, or on every address without them."""
    ips = ss.node.ips_of(pkt.dst.version)
    return pkt.dst in ips if ips else pkt.dst_local


def _relay(ss: ServiceSet, pkt: Packet, p: Path) -> list[Path]:
    on_nodeport = _nodeport_listener(ss, pkt)
    for fp in ss.family_ports(pkt.dst.version):
        addrs = (fp.cluster_ip, *fp.external_ips, *fp.lb_ips)
        if fp.sp.protocol != pkt.proto or not (
                (pkt.dst in addrs and pkt.dport == fp.sp.port)
                or (on_nodeport and fp.sp.node_port == pkt.dport)):
            continue
        internal = pkt.dst == fp.cluster_ip
        p.lookups += 1
        where = "a local address on usproxy0" if internal else "a local address of this node"
        eps = [str(e) for e in (fp.internal if internal else fp.external)]
        hostport = format_hostport(pkt.dst, pkt.dport)
        if _relay_blocks(ss, fp, pkt):
            p.note(f"usproxy: {hostport} is a LoadBalancer IP whose listener carries a socket filter "
                   f"of loadBalancerSourceRanges; {pkt.src} is outside them (kube-proxy 1.0 had "
                   "no such filter)")
            p.result, p.lands = "dropped by the kernel before the handshake: no answer", "DROP"
            return [p]
        if not eps:
            p.note(f"usproxy: {hostport} is {where}, but the relay does not listen while "
                          "the ServicePort has no usable endpoint")
            p.result, p.lands = f"refused by the kernel: {_refused(pkt)}", "REJECT"
            return [p]
        p.note(f"usproxy: {hostport} is {where}: the kernel's socket lookup finds the "
                      f"relay's listener (kube-proxy 1.0 listened on 0.0.0.0:{proxy_port(fp)})")
        return _split_relay(eps, p, f"relay picks an endpoint ({fp.sp.lb_policy or 'roundRobin'})")
    p.lookups += 1
    if any(pkt.dst == fp.cluster_ip or pkt.dst in fp.external_ips
           for fp in ss.family_ports(pkt.dst.version)):
        p.result = (f"a Service address, but no ServicePort on this port: refused by the kernel "
                    f"({_refused(pkt)})")
        p.lands = "REJECT"
    else:
        p.result = "no listener: routed as addressed"
    return [p]


def _relay_blocks(ss: ServiceSet, fp: FamilyPort, pkt: Packet) -> bool:
    """Whether the relay's socket filter drops `pkt` (usproxy/relay/source_filter.py), with the
    sources usproxy.model.source_ranges.allowed_sources gives the relay."""
    if not fp.firewalled or pkt.dst not in fp.lb_ips or pkt.dport != fp.sp.port:
        return False
    sources = allowed_sources(fp.source_ranges, fp.family, fp.lb_ips, ss.node.ips)
    return not allows(sources, pkt.src)


def _split_relay(eps: list[str], p: Path, hop: str) -> list[Path]:
    out = []
    for ep in eps:
        q = p.fork(Fraction(1, len(eps)))
        q.note(hop)
        q.result, q.lands = f"to {ep} (a second connection, from the relay)", ep
        q.seen = "this node (the relay's second connection)"
        out.append(q)
    return out


def render(ss: ServiceSet, pkt: Packet, modes: Sequence[Mode], opts: TraceOptions = NO_OPTIONS,
           detail: bool = False, about: str = "") -> str:
    """Every mode's paths for `pkt`, told as trace_story tells them: one answer line per mode,
    then the hops (`detail`: every path in full); `opts` as `explain trace`'s flags
    (--bpf-lb-mode); `about`: a line saying what the source is."""
    return trace_story.render(ss, pkt, modes, opts, detail, about)
