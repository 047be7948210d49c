"""SourceFilter: loadBalancerSourceRanges on a relay listener's socket, as a kernel drop.

kube-proxy drops a connection to a LoadBalancer IP from a source outside the Service's
loadBalancerSourceRanges (nftables firewall chain, `drop`): the client gets no answer at all.
The relay does the same with a classic BPF socket filter (SO_ATTACH_FILTER, socket(7)) on the
listener of each filtered LB IP: the kernel runs it on every packet queued to the socket, a TCP
SYN to the listener included, so a blocked client's SYN is dropped before any handshake (it
times out, never reaches an endpoint) and its UDP datagrams never reach userspace. Listeners of
other frontends carry no filter: nothing is added to their path.

The program loads the source address from the network header (SKF_NET_OFF: the socket layer
has already pulled it) and accepts when it matches one range under its mask, word by word for
IPv6; anything else returns 0 (drop). `allows()` is the same decision in Python, which the TCP
and UDP relays also apply before dialing or opening a flow: a connection the kernel completed
in the moment before the filter was attached or changed is reset, never relayed.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from collections.abc import Sequence

from usproxy.model.types import IPNetwork

SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27  # asm-generic/socket.h
SKF_NET_OFF = -0x100000  # linux/filter.h: offsets from the network header
BPF_LD_W_ABS, BPF_ALU_AND_K, BPF_JEQ_K, BPF_RET_K = 0x20, 0x54, 0x15, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0
MAX_INSNS = 4096  # BPF_MAXINSNS


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(sources: Sequence[IPNetwork]) -> bytes:
    """The filter's instructions (struct sock_filter[]): accept a packet whose source address is
    in one of `sources` (all of one family), drop the rest. Raises ValueError past BPF_MAXINSNS."""
    out: list[bytes] = []
    for net in sources:
        addr = net.network_address.packed
        mask = net.netmask.packed
        base = 12 if net.version == 4 else 8  # source address offset in the IP header
        words = max(1, -(-net.prefixlen // 32))
        for i in range(words):
            m = int.from_bytes(mask[4 * i:4 * i + 4], "big")
            v = int.from_bytes(addr[4 * i:4 * i + 4], "big")
            skip = 3 * (words - i) - 2  # from this word's jeq past the block's ret
            out += [_insn(BPF_LD_W_ABS, 0, 0, SKF_NET_OFF + base + 4 * i),
                    _insn(BPF_ALU_AND_K, 0, 0, m),
                    _insn(BPF_JEQ_K, 0, skip, v)]
        out.append(_insn(BPF_RET_K, 0, 0, ACCEPT))
    out.append(_insn(BPF_RET_K, 0, 0, DROP))
    if len(out) > MAX_INSNS:
        raise ValueError(f"{len(sources)} source ranges need {len(out)} BPF instructions (at most {MAX_INSNS})")
    return b"".join(out)


def attach(sock: socket.socket, sources: Sequence[IPNetwork]) -> None:
    """Filter `sock` to `sources` (replacing any filter), or remove its filter when empty.
    Raises OSError from the kernel, ValueError for too many ranges."""
    if not sources:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        except OSError:
            pass  # ENOENT: it had none
        return
    code = program(sources)
    buf = ctypes.create_string_buffer(code, len(code))  # the kernel copies it during the call
    fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def allows(sources: Sequence[IPNetwork], client: str) -> bool:
    """Whether a client address (text, as a socket reports it) passes `sources` (empty: all)."""
    if not sources:
        return True
    try:
        ip = ipaddress.ip_address(client.split("%", 1)[0])
    except ValueError:
        return False
    return any(ip in n for n in sources)
