"""The rest of a traced connection: later packets, the reply path and the source the backend sees.

For one `Path` of one mode: only the first packet walks the rules; later packets and every reply
ride what the first one left behind (netfilter conntrack for iptables and nftables, IPVS's own
connection table plus conntrack for IPVS, the connected socket for BPF socket LB, two sockets in
the relay's flow table for userspace). The reply is un-DNATed (and un-SNATed when masqueraded)
back to the Service address the client used. Masquerade happens in nat POSTROUTING (iptables
KUBE-POSTROUTING, the nftables `masquerading` chain; IPVS uses iptables' KUBE-POSTROUTING), never
for socket LB and never for the relay, whose second connection simply starts at this node. The
rules quoted are the views' own (iptables.build, nftables.build, ipvs.iptables_helpers).
"""

from __future__ import annotations

from collections.abc import Callable

from usproxy.explain import ipvs, nftables, tc_trace
from usproxy.offload.iptables import rules as iptables
from usproxy.explain.mode import Mode
from usproxy.explain.packet import Packet, Path
from usproxy.model.service_set import ServiceSet
from usproxy.model.types import format_hostport

NODE_SOURCE = "this node's address on the interface toward the backend"


def lines(mode: Mode, ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    """What happens after the first packet of `p`, one sentence a line: the same for every mode
    when no backend was reached, else `mode.reply`."""
    if p.lands == "DROP":
        return ["no reply: the first packet is dropped; the client retries, then times out"]
    if p.lands == "":
        return [f"not a Service connection here: nothing was translated, so any reply comes from "
                f"whatever answers {_orig(pkt)}"]
    if p.lands == "REJECT":
        return [mode.refusal(pkt, p)]
    if p.lands == "ACCEPT":
        return [f"nothing was translated: the connection is this node's own, to whatever listens on "
                f"{_orig(pkt)} (the service health server), and its replies come from there"]
    return mode.reply(ss, pkt, p)


def _orig(pkt: Packet) -> str:
    return format_hostport(pkt.dst, pkt.dport)


# --- refused: the answer the client gets ------------------------------------------------------
# iptables `-j REJECT` and nft `reject` answer with ICMP port unreachable (their default), as IPVS
# with no real server; only a closed port with no listener (the relay's, or the stack's behind tc)
# gets a TCP RST.

def _refused_with(answer: str, pkt: Packet) -> str:
    return (f"no connection: this node answers the first packet with {answer}, from "
            f"{_orig(pkt)}, so the client fails at once instead of timing out")


def icmp_refusal(pkt: Packet, p: Path) -> str:
    """A reject rule's or an empty virtual server's answer (iptables, ipvs, nftables)."""
    return _refused_with("ICMP port unreachable", pkt)


def closed_port_refusal(pkt: Packet, p: Path) -> str:
    """No listener on the port (the relay listens only while it has endpoints)."""
    return _refused_with("a TCP RST" if pkt.proto == "TCP" else "ICMP port unreachable", pkt)


def bpf_refusal(pkt: Packet, p: Path) -> str:
    """The socket LB fails connect() itself; what tc passes goes to the stack's closed port; the
    nftables fallback rejects."""
    if "connect()" in p.result:
        return "no packet leaves: connect() itself fails with ECONNREFUSED"
    if p.result.startswith(tc_trace.TC_RESULT):
        return closed_port_refusal(pkt, p)
    return icmp_refusal(pkt, p)


# --- reached a backend --------------------------------------------------------------------------

def iptables_reply(ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    """conntrack, with KUBE-POSTROUTING's MASQUERADE rule when the packet was marked."""
    def rule() -> str:
        rs = iptables.build(ss, pkt.dst.version)
        r = next(r for r in rs.rules if r.chain == iptables.POSTROUTING and r.target == "MASQUERADE")
        return f"nat {iptables.POSTROUTING}: {r.text()}"

    return _conntrack(pkt, p, rule)


def nftables_reply(ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    """conntrack, with the `masquerading` chain's rule when the packet was marked."""
    def rule() -> str:
        t = nftables.build(ss, pkt.dst.version)
        text = next(r.text for r in t.chains["masquerading"].rules if r.text.startswith("masquerade"))
        return f"masquerading (hooked at nat-postrouting): {text}"

    return _conntrack(pkt, p, rule)


def _seen(pkt: Packet, p: Path) -> str:
    return NODE_SOURCE if p.masquerade else f"the client's own address {pkt.src}"


def _conntrack(pkt: Packet, p: Path, masquerade_rule: Callable[[], str]) -> list[str]:
    out = ["conntrack: only this first packet walked the rules; the translation is stored in its "
           "conntrack entry, so later packets and every reply skip the nat rules"]
    if p.masquerade:
        out.append(f"source NAT (the packet carries the masquerade mark): {masquerade_rule()}")
    else:
        out.append("no source NAT: nothing marked this packet for masquerade")
    return out + _sees_and_reply(pkt, p)
def _sees_and_reply(pkt: Packet, p: Path) -> list[str]:
    undo = (f"the destination back to {pkt.src} (un-SNAT) and " if p.masquerade else "")
    return [f"the backend {p.lands} sees the connection from {_seen(pkt, p)}",
            f"reply from {p.lands}: conntrack turns {undo}the source back to {_orig(pkt)} "
            f"(un-DNAT), so the client gets its replies from the address it connected to"]


def ipvs_reply(ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    out = ["IPVS keeps this connection in its own table (ipvsadm -Lnc): later packets go to the "
           "same real server without walking the rules; netfilter conntrack tracks it too "
           "(kube-proxy sets net.ipv4.vs.conntrack=1), which lets POSTROUTING masquerade it",
           f"forwarding method Masq rewrote the destination only: {_orig(pkt)} -> {p.lands}"]
    if p.masquerade and not any("KUBE-LOOP-BACK" in h for h in p.hops):
        rule = next(line for line in ipvs.iptables_helpers(ss, pkt.dst.version).splitlines()
                    if line.startswith("-A KUBE-POSTROUTING") and "requiring SNAT" in line)
        out.append(f"source NAT (the packet carries the masquerade mark): nat KUBE-POSTROUTING: {rule}")
    elif p.masquerade:
        out.append("source NAT: the KUBE-LOOP-BACK rule above (a pod reaching itself)")
    else:
        out.append("no source NAT: nothing marked this packet for masquerade")
    return out + _sees_and_reply(pkt, p)


def bpf_reply(ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    """usproxy's nftables fallback, the tc program's conntrack, or the socket LB's connect()."""
    if p.result.startswith("nftables fallback"):
        return ["(usproxy's nftables fallback, as nftables mode:)", *nftables_reply(ss, pkt, p)]
    if p.result.startswith(tc_trace.TC_RESULT):
        return tc_trace.reply_lines(pkt, p)
    return _socket_lb(pkt, p)


def _socket_lb(pkt: Packet, p: Path) -> list[str]:
    per = ("each sendmsg() of an unconnected UDP socket is rewritten the same way"
           if pkt.proto == "UDP" else "later packets need no lookup at all")
    return [f"no packet is translated: connect() connected the socket to {p.lands} itself, so every "
            f"packet carries {p.lands} from the start ({per}); conntrack, if loaded, sees a plain "
            "connection with no NAT",
            f"the backend {p.lands} sees the client's own address {pkt.src}: no source NAT anywhere",
            f"replies come from {p.lands}; the getpeername() hook (and recvmsg() for UDP) shows "
            f"the application {_orig(pkt)} instead (reverse NAT by the frontend's revNAT ID)"]


def userspace_reply(ss: ServiceSet, pkt: Packet, p: Path) -> list[str]:
    first = (f"{pkt.src} -> {_orig(pkt)} ends at the relay's listener (accept())"
             if pkt.proto == "TCP" else f"datagrams from {pkt.src} to {_orig(pkt)} reach the "
             "relay's socket, one session per client address and port")
    out = [f"two connections, no NAT: {first}; the relay opens a second one from this node to "
           f"{p.lands} and copies the bytes between them; its own flow table pairs the two "
           "(`usproxy flows`, /flows on the metrics address)",
           f"the backend {p.lands} sees {NODE_SOURCE} (the second connection's source, chosen "
           "by routing): never the client's address",
           f"replies: the backend answers the relay, which writes them on the first connection, "
           f"whose local address is {_orig(pkt)}: nothing to un-NAT"]
    if pkt.dst.version == 4:
        out.append(f"kube-proxy 1.0 did the same behind its portal rule: conntrack turned the "
                   f"source of its replies back from the proxy port to {_orig(pkt)}")
    return out
