"""UdpBatch: datagrams read back to back for one flow, sent by one sendmsg with UDP_SEGMENT (GSO).

The UDP relay reads up to 64 datagrams per readiness callback. Sent one send(2) each, the kernel's
send path (route, netfilter, veth and bridge, the receiver's queue) was 70 % of relay CPU under a
UDP flood (py-spy, bench UDP 1400 B). Datagrams read one after the other for the same flow, all of
one size (the last may be shorter), leave as one GSO datagram instead: the kernel carries it as one
packet as far as it can and cuts it into the same datagrams again (UDP_SEGMENT, Linux 4.18, udp(7)),
so each arrives as its own datagram with its own boundaries, in order (C05). A lone datagram is sent
as before, so request/response traffic is unchanged.

Bounds: segments of at most MAX_SEGMENT bytes, at most MAX_SEGMENTS of them and MAX_BYTES in all per
batch (the kernel's limits: UDP_MAX_SEGMENTS, one IPv4 datagram). A batch the kernel refuses
(EINVAL or EMSGSIZE: a path MTU below the segment size, no GSO on the way) is the sender's to resend
datagram by datagram (`UdpBatch.singly`).

Buffer layout (one buffer shared by the relay's callbacks, which never nest): the pending batch is
buf[start:end]; the next datagram is read at `room()`, which always has MAX_DATAGRAM bytes free, so
no datagram is ever truncated. `flush()` sends the pending batch; every callback flushes before it
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
    """The pending batch in a shared buffer; see the module docstring for the layout."""

    __slots__ = ("buf", "view", "start", "end", "count", "segment", "key", "send", "target")

    def __init__(self) -> None:
        self.buf = bytearray(2 * (MAX_DATAGRAM + 1))
        self.view = memoryview(self.buf)
        self.start = self.end = self.count = self.segment = 0
        self.key: Hashable = None
        self.send: Sender | None = None
        self.target: Any = None

    def room(self) -> memoryview:
        """Where to read the next datagram: MAX_DATAGRAM bytes right after the pending batch."""
        if not self.count:
            self.start = self.end = 0
        elif self.end + MAX_DATAGRAM > len(self.buf):
            n = self.end - self.start
            self.buf[0:n] = self.view[self.start:self.end]
            self.start, self.end = 0, n
        return self.view[self.end:self.end + MAX_DATAGRAM]

    def joins(self, key: Hashable, n: int) -> bool:
        """Whether a datagram of n bytes for `key`, just read at room(), can join the pending batch."""
        return (self.count > 0 and key == self.key and n <= self.segment <= MAX_SEGMENT
                and self.count < MAX_SEGMENTS and self.end - self.start + n <= MAX_BYTES
                and (self.end - self.start) == self.count * self.segment)  # no short one yet

    def take(self, key: Hashable, n: int, send: Sender, target: Any) -> None:
        """Add the datagram of n bytes read at room() for `key`; the caller flushed first unless
        joins() said yes. `send(target, data, segment)` sends the batch at flush()."""
        if not self.count:
            self.start = self.end
            self.key, self.segment, self.send, self.target = key, n, send, target
        self.end += n
        self.count += 1

    def flush(self) -> None:
        """Send the pending batch (one datagram: a plain send)."""
        if not self.count:
            return
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
