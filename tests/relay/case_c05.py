"""Field case C05's datagram sizes and the whole-datagram receive, shared by the relay test
(test_c05_udp_sizes) and the offload run of the field cases (tests/offload/test_field_cases_offload)."""

from __future__ import annotations

import socket

SIZES = [0, 1, 512, 1472, 1473, 4095, 4096, 4097, 8192, 8193, 16384, 32768, 65000, 65507]


def recv_whole(s: socket.socket) -> bytes:
    """One datagram; fails if the kernel flags it as truncated (buffer larger than any datagram)."""
    data, _, flags, _ = s.recvmsg(1 << 17)
    assert not flags & socket.MSG_TRUNC
    return data
