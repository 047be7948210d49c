"""A packet from elsewhere or a pod here to a NodePort, LB IP or externalIP, through usproxy's tc program.

What `usp_tc_ingress` (usproxy/offload/bpf/sock_lb.c, tc_frontends.h, dsr.h) does with the first
packet of a new flow, in its order: the frontend in usp_services (an LB IP or externalIP entry of
its own flagged F_TC_ONLY, else the NodePort entry 0.0.0.0:nodePort for a destination in
usp_tc_addrs), loadBalancerSourceRanges (LPM usp_tc_sources, LB IPs only), no endpoints (dropped
for eTP=Local with endpoints elsewhere, else passed to the stack, which refuses), sessionAffinity,
the Maglev pick, DNAT and SNAT or DSR. The groups mirror usproxy/offload/bpf/datapath.py
`_external_wants`. `trace` returns the paths, or the reason tc passes the packet to the stack
untouched (IPv6, SCTP, no tc frontend) so the caller traces the fallback there. Shares are the
Maglev table's own (maglev.table over the same endpoint names as tables.py), in 1/MAGLEV_M.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from fractions import Fraction

from usproxy.model.endpoint import Endpoint
from usproxy.explain import bpf
from usproxy.explain.packet import Packet, Path
from usproxy.model.service_set import ServiceSet
from usproxy.offload.bpf import maglev
from usproxy.offload.bpf.layout import MAGLEV_M
from usproxy.model.source_ranges import allowed_sources, allows
from usproxy.model.types import format_hostport

TC_RESULT = "tc: "  # every result of a path the tc program decided starts so (reply.py reads it)
XDP_NOTE = (
    "XDP: with --bpf-lb-acceleration native, usp_xdp runs this same lookup first on an interface "
    "whose driver has native XDP, for NodePort flows whose backend leaves by the interface they came "
    "in on (sent with XDP_TX); it passes to tc LB IPs and externalIPs, sessionAffinity, DSR, "
    "NodePorts without endpoints, backends behind another interface, and every packet of a flow not "
    "confirmed yet (tc confirms it)")


def trace(ss: ServiceSet, pkt: Packet, lb_mode: str) -> list[Path] | str:
    """The tc paths of `pkt` (`lb_mode` "snat" or "dsr", as `usproxy run --bpf-lb-mode`), or why
    tc passes it to the stack untouched."""
    if pkt.dst.version != 4:
        return "IPv6: usproxy's tc programs serve IPv4 only and pass this packet to the stack"
    if pkt.proto not in ("TCP", "UDP"):
        return f"{pkt.proto}: the tc programs serve TCP and UDP only and pass it to the stack"
    fe = _frontend(ss, pkt)
    if fe is None:
        return ("no tc frontend for this destination (not a NodePort at a --nodeport-addresses "
                "address, an LB IP or an externalIP): passed to the stack")
    p = Path()
    p.note("tc ingress (tcx) on the interface that received it: usp_tc_ingress; no conntrack entry "
           "for a new flow (usp_ct holds confirmed TCP flows, usp_ct_any confirmed UDP ones, usp_ct_new "
           "those not confirmed yet). Only a TCP SYN or a UDP datagram opens a flow: a TCP segment of a "
           "flow no table holds passes to the stack, which resets it (at a DSR frontend it goes again "
           "to the backend the Maglev table names, without an entry); the later fragments of a "
           "datagram follow their first fragment (usp_frags)")
    p.note(XDP_NOTE)
    p.lookups += 7  # confirmed table and usp_ct_new for three keys (reply, flow, DSR reply), then usp_services
    _lookup_note(ss, pkt, fe, p)
    refused = _refused(ss, pkt, fe, p)
    if refused:
        return [refused]
    return _picks(ss, pkt, fe, p, lb_mode)


def _frontend(ss: ServiceSet, pkt: Packet) -> bpf.Frontend | None:
    """tc_frontend: an exact LB IP / externalIP entry wins, else the NodePort at a node address."""
    fes = [fe for fe in bpf.frontends(ss) if fe.port == pkt.dport and fe.proto == pkt.proto]
    for fe in fes:
        if fe.type in ("LoadBalancer", "ExternalIPs") and fe.address == pkt.dst:
            return fe
    if pkt.dst not in ss.node.ips_of(4):
        return None
    return next((fe for fe in fes if fe.type == "NodePort" and fe.address == ipaddress.IPv4Address(0)), None)


def _lookup_note(ss: ServiceSet, pkt: Packet, fe: bpf.Frontend, p: Path) -> None:
    zero = f"0.0.0.0:0 ({fe.id}) (0) [{fe.flags}]"
    if fe.type == "NodePort":
        p.lookups += 2  # usp_tc_addrs, then the NodePort entry
        p.note(f"no entry for {format_hostport(pkt.dst, pkt.dport)}; {pkt.dst} is in usp_tc_addrs (a node address tc serves NodePorts on); frontend "
               f"usp_services[{fe.text()}], the NodePort entry: {zero}, flagged tc-only (F_TC_ONLY)")
        return
    p.note(f"frontend usp_services[{fe.text()}] ({fe.type}): {zero}; an entry of its own flagged "
           "tc-only (F_TC_ONLY), so a connect() on this node to it is never rewritten by the socket "
           "LB (a pod's packet is served here at tc; the node's own, which no tc ingress sees, by "
           "nftables or the relay, with their source-range checks)")


def _refused(ss: ServiceSet, pkt: Packet, fe: bpf.Frontend, p: Path) -> Path | None:
    """tc_admit: source ranges (LB IPs only), then no endpoints; None when the packet is served."""
    fp = fe.fp
    if fe.type == "LoadBalancer" and fp.firewalled:
        nets = allowed_sources(fp.source_ranges, 4, fp.lb_ips, ss.node.ips)
        p.lookups += 1
        inside = allows(nets, pkt.src)
        p.note(f"loadBalancerSourceRanges: usp_tc_sources (LPM trie, keyed by service id and source "
               f"prefix) holds {', '.join(map(str, nets))}: {pkt.src} is "
               f"{'inside' if inside else 'outside'} them")
        if not inside:
            p.result, p.lands = TC_RESULT + "dropped (TC_ACT_SHOT): the source is not allowed", "DROP"
            return p
    if fe.backends:
        return None
    if fp.external_policy_local and fp.cluster:
        p.result = (TC_RESULT + "dropped (TC_ACT_SHOT, F_DROP_EMPTY): externalTrafficPolicy Local "
                    "and no endpoint on this node, while the Service has endpoints elsewhere")
        p.lands = "DROP"
        return p
    p.result = (TC_RESULT + "no endpoint: passed to the stack (TC_ACT_OK), where nothing listens (the "
                "relay listens only while there are endpoints): the kernel refuses the closed port")
    p.lands = "REJECT"
    return p


def _picks(ss: ServiceSet, pkt: Packet, fe: bpf.Frontend, p: Path, lb_mode: str) -> list[Path]:
    fp = fe.fp
    if fp.sp.session_affinity == "ClientIP":
        p.lookups += 1
        p.note(f"sessionAffinity ClientIP: usp_affinity[service {fe.id}, {pkt.src}] holds no backend "
               f"for a new client; the pick below is kept there for {fp.sp.affinity_timeout}s")
    names = [f"{ep.ip}:{ep.port}" for ep in fe.backends]
    order = sorted(set(names))
    owned = Counter(maglev.table(names, MAGLEV_M))
    by_name = {f"{ep.ip}:{ep.port}": ep for ep in fe.backends}
    out = []
    for i, name in enumerate(order):
        q = p.fork(Fraction(owned[i], MAGLEV_M))
        q.lookups += 3  # usp_maglev (outer), its inner array, usp_backends
        q.note(f"Maglev: usp_maglev[{fe.id}], a table of {MAGLEV_M} backend ids built from the "
               f"endpoint names (usproxy/offload/bpf/maglev.py, the same on every node); the slot is "
               f"the hash of the client's address and port, {pkt.dport} and {pkt.proto} mod {MAGLEV_M}: "
               f"{name} owns {owned[i]} of the {MAGLEV_M} slots")
        _translate(ss, pkt, fe, by_name[name], q, lb_mode)
        out.append(q)
    return out


def _translate(ss: ServiceSet, pkt: Packet, fe: bpf.Frontend, ep: Endpoint, q: Path, lb_mode: str) -> None:
    """nodeport_new after the pick: DSR (dsr_new), else DNAT with SNAT where usp_tc_ifaces says."""
    local = ss.node.name is not None and ep.node_name == ss.node.name
    where = "on this node" if local else f"on {ep.node_name or 'another node (nodeName unset)'}"
    q.lands = str(ep)
    if fe.fp.external_policy_local:
        q.result = (f"{TC_RESULT}DNAT to {ep} ({where}: eTP=Local keeps local endpoints only), no SNAT "
                    "(F_LOCAL_ONLY): the client's address is kept")
    elif not local and lb_mode == "dsr":
        q.result = (f"{TC_RESULT}DSR: DNAT to {ep} ({where}) without SNAT; an IPv4 option (type 0x9a, "
                    f"8 bytes) carries {format_hostport(pkt.dst, pkt.dport)} to the backend's node, "
                    "sent with bpf_fib_lookup + bpf_redirect_neigh (as SNAT instead when the packet "
                    "already has IP options, or a UDP datagram would not fit the MTU with them)")
    elif not local:
        q.result = (f"{TC_RESULT}DNAT to {ep} ({where}) and SNAT to this node's address on the interface "
                    "toward it (usp_tc_ifaces), sent with bpf_fib_lookup + bpf_redirect_neigh")
        q.masquerade = True
    else:  # tc is on every interface holding a node address by default: the pod bridge too
        q.result = (f"{TC_RESULT}DNAT to {ep} ({where}) and SNAT to the address of the interface it is "
                    "reached through (usp_tc_ifaces: the pod bridge, hooked as every interface holding "
                    "a node address is without --nodeport-addresses; behind an interface tc does not "
                    "run on, the client's address is kept)")
        q.masquerade = True


def reply_lines(pkt: Packet, p: Path) -> list[str]:
    """After the first packet of a tc path that reached a backend: usp_ct and the reply."""
    orig, client = format_hostport(pkt.dst, pkt.dport), f"{pkt.src}:<port>"
    ct = ("conntrack (LRU tables: both entries start in usp_ct_new, 60 s; they move to usp_ct, TCP 6 h, "
          "once the backend's SYN-ACK passed and the client acknowledged it, or to usp_ct_any, UDP 60 s, "
          "once a reply passed and the client sent again; 10 s after the backend's FIN or RST; ICMP "
          "errors about the flow are reverse-NATed with it)")
    if "DSR:" in p.result:
        return [f"{ct} on this node: only the ORIGINAL entry ({client} -> {orig} => {p.lands}, flag "
                "CT_DSR), never confirmed here (no reply passes); later packets follow it (TCP carries "
                "the option on the SYN only, UDP on every datagram that fits)",
                f"the backend's node (dsr_recv at its tc ingress) records a REPLY entry {p.lands} -> "
                f"{client} naming {orig} from the SYN, when it serves that frontend in DSR mode too (a "
                "NodePort only at a peer node's address: in usp_dsr_peers, reached through the interface "
                f"the SYN came in on) and {p.lands} is one of its backends; no later packet rewrites it",
                f"the backend {p.lands} sees the client's own address {pkt.src}",
                f"reply from {p.lands}: its node's tc rewrites the source to {orig} where the reply "
                "first meets a hooked interface (the pod bridge) and sends it straight to the client: "
                "it never passes this node"]
    if p.masquerade:
        return [f"{ct}: the ORIGINAL entry ({client} -> {orig} => {p.lands}) carries later packets "
                f"without a lookup; the REPLY entry ({p.lands} -> this node's address:SNAT port) is "
                "the reverse NAT (the SNAT port is the client's own unless taken, else a hashed one)",
                f"the backend {p.lands} sees the connection from this node's address (the SNAT address "
                "above), never the client's",
                f"reply from {p.lands} comes back to that address: tc ingress there finds the REPLY entry, turns the "
                f"destination back to {client} (un-SNAT) and the source to {orig} (un-DNAT), and sends "
                "it on"]
    return [f"{ct}: the ORIGINAL entry ({client} -> {orig} => {p.lands}) carries later packets; the "
            f"REPLY entry ({p.lands} -> {client}) is the reverse NAT",
            f"the backend {p.lands} sees the connection from the client's own address {pkt.src}: "
            "no source NAT (F_LOCAL_ONLY)",
            f"reply from {p.lands}: the first tc hook it meets (the ingress of a hooked interface such "
            f"as the pod bridge, else the egress toward the client) finds the REPLY entry and turns "
            f"its source back to {orig} (un-DNAT), so the client gets its reply from the address it used"]
