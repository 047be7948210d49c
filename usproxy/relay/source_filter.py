"""SourceFilter: loadBalancerSourceRanges on a relay listener's socket, as a kernel drop.

kube-proxy drops a connection to a LoadBalancer IP from a source outside the Service's
loadBalancerSourceRanges (nftables firewall chain, `drop`): the client gets no answer at all.
The relay does the same with a classic BPF socket filter (SO_ATTACH_FILTER, socket(7)) on the
listener of each filtered LB IP: the kernel runs it on every packet queued to the socket, a TCP
SYN to the listener included, so a blocked client's SYN is dropped before any handshake (it
times out, never reaches an endpoint) and its UDP datagrams never reach userspace. Listeners of
other frontends carry no filter: nothing is added to their path.

The same filter carries the relay's other drops (kube-proxy's DROP verdicts, service_port_relay.py):
a listener of an internalTrafficPolicy Local ServicePort without a local endpoint drops everything
(`DROP_ALL`), and an external frontend of an externalTrafficPolicy Local one without a local endpoint
accepts only pods and the node itself (client_origin.py), whose traffic kube-proxy short-circuits
to every endpoint. So a filter is a conjunction of `Clause`s, each accepting a packet whose source
address is in one of its networks or which arrived on one of its interfaces (by index: the kernel's
SKF_AD_IFINDEX, `lo` for the node's own traffic); a packet that passes every clause is accepted.

The program loads the source address from the network header (SKF_NET_OFF: the socket layer
has already pulled it) and compares it with one range under its mask, word by word for IPv6, or
loads the ingress interface's index; a clause none of whose alternatives matches returns 0
(drop), a matching one jumps to the next clause. `allows()` is the same source-range decision in
Python, which the TCP and UDP relays also apply before dialing or opening a flow: a connection the
kernel completed in the moment before the filter was attached or changed is reset, never relayed.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from usproxy.model.types import IPNetwork, unmapped

SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27  # asm-generic/socket.h
SKF_NET_OFF = -0x100000  # linux/filter.h: offsets from the network header
SKF_AD_IFINDEX = -0x1000 + 8  # SKF_AD_OFF + SKF_AD_IFINDEX: the index of the interface it came in on
BPF_LD_W_ABS, BPF_ALU_AND_K, BPF_JEQ_K, BPF_JA, BPF_RET_K = 0x20, 0x54, 0x15, 0x05, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0
MAX_INSNS = 4096  # BPF_MAXINSNS
LOOPBACK_IFINDEX = 1  # `lo` in every network namespace: where the node's own packets come in


@dataclass(frozen=True, slots=True)
class Clause:
    """Accepts a packet whose source is in one of `sources` (one family) or that arrived on one
    of `ifindexes`; a clause with neither accepts nothing."""

    sources: tuple[IPNetwork, ...] = ()
    ifindexes: tuple[int, ...] = ()


DROP_ALL: tuple[Clause, ...] = (Clause(),)  # kube-proxy's DROP for every client


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(sources: Sequence[IPNetwork]) -> bytes:
    """The filter's instructions (struct sock_filter[]): accept a packet whose source address is
    in one of `sources` (all of one family), drop the rest. Raises ValueError past BPF_MAXINSNS."""
    return program_of((Clause(tuple(sources)),))


def program_of(clauses: Sequence[Clause]) -> bytes:
    """The instructions of a filter that accepts a packet passing every clause (none: all).
    Raises ValueError past BPF_MAXINSNS."""
    out: list[bytes] = []
    for clause in clauses:
        blocks = [_source_block(net) for net in clause.sources] + [_ifindex_block(i) for i in clause.ifindexes]
        # a block falls through on a match into its jump past the clause's DROP: patched below
        ends = []
        for block in blocks:
            out += block
            ends.append(len(out))
            out.append(b"")
        out.append(_insn(BPF_RET_K, 0, 0, DROP))
        for end in ends:
            out[end] = _insn(BPF_JA, 0, 0, len(out) - end - 1)
    out.append(_insn(BPF_RET_K, 0, 0, ACCEPT))
    if len(out) > MAX_INSNS:
        n = sum(len(c.sources) + len(c.ifindexes) for c in clauses)
        raise ValueError(f"{n} source ranges and interfaces need {len(out)} BPF instructions (at most {MAX_INSNS})")
    return b"".join(out)


def _source_block(net: IPNetwork) -> list[bytes]:
    """Compare the source address with `net` word by word; a mismatch skips past the block and
    the jump that follows it (to the next alternative)."""
    addr, mask = net.network_address.packed, net.netmask.packed
    base = 12 if net.version == 4 else 8  # source address offset in the IP header
    words = max(1, -(-net.prefixlen // 32))
    out = []
    for i in range(words):
        m = int.from_bytes(mask[4 * i:4 * i + 4], "big")
        v = int.from_bytes(addr[4 * i:4 * i + 4], "big")
        skip = 3 * (words - i) - 2  # from this word's jeq past the block's jump
        out += [_insn(BPF_LD_W_ABS, 0, 0, SKF_NET_OFF + base + 4 * i),
                _insn(BPF_ALU_AND_K, 0, 0, m),
                _insn(BPF_JEQ_K, 0, skip, v)]
    return out


def _ifindex_block(index: int) -> list[bytes]:
    return [_insn(BPF_LD_W_ABS, 0, 0, SKF_AD_IFINDEX), _insn(BPF_JEQ_K, 0, 1, index)]


def attach(sock: socket.socket, sources: Sequence[IPNetwork]) -> None:
    """Filter `sock` to `sources` (replacing any filter), or remove its filter when empty.
    Raises OSError from the kernel, ValueError for too many ranges."""
    attach_clauses(sock, (Clause(tuple(sources)),) if sources else ())


def attach_clauses(sock: socket.socket, clauses: Sequence[Clause]) -> None:
    """Filter `sock` to packets that pass every clause (replacing any filter), or remove its
    filter when there is none. Raises OSError from the kernel, ValueError for too many."""
    if not clauses:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        except OSError:
            pass  # ENOENT: it had none
        return
    code = program_of(clauses)
    buf = ctypes.create_string_buffer(code, len(code))  # the kernel copies it during the call
    fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def allows(sources: Sequence[IPNetwork], client: str) -> bool:
    """Whether a client address (text, as a socket reports it) passes `sources` (empty: all)."""
    if not sources:
        return True
    try:
        ip = unmapped(ipaddress.ip_address(client.split("%", 1)[0]))  # a dual-stack socket's v4 peer
    except ValueError:
        return False
    return any(ip in n for n in sources)
