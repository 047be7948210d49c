"""UdpBatch: datagrams read back to back for one flow, sent by one sendmsg with UDP_SEGMENT (GSO).

The UDP relay reads up to 64 datagrams per readiness callback. Sent one send(2) each, the kernel's
send path (route, netfilter, veth and bridge, the receiver's queue) was 70 % of relay CPU under a
UDP flood (py-spy, bench UDP 1400 B). Datagrams read one after the other for the same flow, all of
one size (the last may be shorter), leave as one GSO datagram instead: the kernel carries it as one
packet as far as it can and cuts it into the same datagrams again (UDP_SEGMENT, Linux 4.18, udp(7)),
so each arrives as its own datagram with its own boundaries, in order (C05). A lone datagram is sent
as before; one under MIN_SEGMENT bytes with nothing pending skips the batch altogether, so small
request/response traffic (DNS) costs what it did.

Bounds: segments of at most MAX_SEGMENT bytes, at most MAX_SEGMENTS of them and MAX_BYTES in all per
batch (the kernel's limits: UDP_MAX_SEGMENTS, one IPv4 datagram). A batch the kernel refuses
(EINVAL or EMSGSIZE: a path MTU below the segment size, no GSO on the way) is the sender's to resend
datagram by datagram (`UdpBatch.singly`).

Buffer layout (one buffer shared by the relay's callbacks, which never nest): the pending batch is
buf[start:end]; the next datagram is read at `free`, which always has MAX_DATAGRAM bytes, so no
datagram is ever truncated. `flush()` sends the pending batch; every callback flushes before it
returns, so nothing waits in the buffer across loop iterations.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable, Hashable
from typing import Any

MAX_DATAGRAM = 65535
MAX_SEGMENT = 1472  # one datagram in a 1500-byte MTU over IPv4; larger ones go singly
# Smaller datagrams with no batch pending (DNS, request/response) are sent at once by the caller:
# a batch of them saves little, and its bookkeeping costs ~1.5 us of Python per datagram.
MIN_SEGMENT = 512
MAX_SEGMENTS = 64
MAX_BYTES = 65507
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
REFUSED = (errno.EINVAL, errno.EMSGSIZE, errno.EOPNOTSUPP, errno.EIO)  # GSO not possible on this path
SEGMENT = struct.Struct("=H")

# send(target, data, segment): segment 0 for one datagram, else the size of each of its datagrams
Sender = Callable[[Any, memoryview, int], None]


def send_segments(sock: socket.socket, data: memoryview, segment: int, address: Any = None) -> None:
    """One sendmsg of `data` as datagrams of `segment` bytes (the last may be shorter), to the
    connected peer or `address`. Raises OSError as sendmsg(2)."""
    cmsg = [(SOL_UDP, UDP_SEGMENT, SEGMENT.pack(segment))]
    if address is None:
        sock.sendmsg([data], cmsg)
    else:
        sock.sendmsg([data], cmsg, 0, address)


def refused(err: OSError) -> bool:
    """Whether a batched send failed because the path cannot segment it (resend singly)."""
    return err.errno in REFUSED


class UdpBatch:
    """The pending batch in a shared buffer; see the module docstring for the layout. Per
    datagram the relay's callbacks make one call (`add`), per callback one more (`flush`)."""

    __slots__ = ("buf", "view", "head", "free", "start", "end", "count", "segment", "key", "send", "target")

    def __init__(self) -> None:
        self.buf = bytearray(2 * (MAX_DATAGRAM + 1))
        self.view = memoryview(self.buf)
        self.head = self.view[:MAX_DATAGRAM]
        self.free = self.head  # where the next datagram is read: MAX_DATAGRAM bytes after the batch
        self.start = self.end = self.count = self.segment = 0
        self.key: Hashable = None
        self.send: Sender | None = None
        self.target: Any = None

    def joins(self, key: Hashable, n: int) -> bool:
        """Whether a datagram of n bytes for `key`, read at `free`, would join the pending batch."""
        count = self.count
        return (count > 0 and key == self.key and n <= self.segment <= MAX_SEGMENT and count < MAX_SEGMENTS
                and self.end - self.start + n <= MAX_BYTES
                and self.end - self.start == count * self.segment)  # no short one yet

    def add(self, key: Hashable, n: int, send: Sender, target: Any) -> None:
        """Take the datagram of n bytes just read at `free`, for `key`: it joins the pending batch,
        or the pending batch is sent first and it starts the next. `send(target, data, segment)`
        sends a batch."""
        if self.count and not self.joins(key, n):
            self._send()
        if not self.count:
            self.start = self.end
            self.key, self.segment, self.send, self.target = key, n, send, target
        self.end += n
        self.count += 1
        if self.end + MAX_DATAGRAM > len(self.buf):  # keep room for a whole datagram: compact
            size = self.end - self.start
            self.buf[0:size] = self.view[self.start:self.end]
            self.start, self.end = 0, size
        self.free = self.view[self.end:self.end + MAX_DATAGRAM]

    def flush(self) -> None:
        """Send the pending batch, if any (one datagram: a plain send); the buffer is empty after."""
        if self.count:
            self._send()
        self.start = self.end = 0
        self.free = self.head

    def cut(self) -> None:
        """Send the pending batch now, leaving the datagram just read at `free` where it is."""
        if self.count:
            self._send()

    def _send(self) -> None:
        data = self.view[self.start:self.end]
        segment = self.segment if self.count > 1 else 0
        send, target = self.send, self.target
        self.start, self.count, self.send, self.target, self.key = self.end, 0, None, None, None
        assert send is not None
        send(target, data, segment)

    @staticmethod
    def singly(data: memoryview, segment: int) -> list[memoryview]:
        """The datagrams of a batch, for a path that refused it as one."""
        return [data[i:i + segment] for i in range(0, len(data), segment)]
