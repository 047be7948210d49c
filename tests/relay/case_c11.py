"""Field case C11's Services and clients: `blob` (write L bytes, close at once) and `upload` (read
to EOF, answer count and sha256) behind one ClusterIP, shared by the relay tests
(test_c11_flush_before_fin, test_bulk_transfer, test_stop_resets_flows) and the offload run of the
field cases (tests/offload/test_field_cases_offload)."""

from __future__ import annotations

import asyncio
import hashlib
import struct

from tests.relay.harness import slice_, svc
from tests.relay.tcp_servers import MIB, pattern_chunks

VIP = "10.96.70.70"


BE = "10.244.1.15"


BLOB, UPLOAD = 8080, 8081


SIZES = (0, 1, 65535, 65536, 65537, MIB + 1, 16 * MIB)


def objects() -> list[dict[str, object]]:
    return [svc("blob", VIP, [{"name": "blob", "port": BLOB, "targetPort": BLOB},
                              {"name": "upload", "port": UPLOAD, "targetPort": UPLOAD}]),
            slice_("blob", [{"ip": BE, "ready": True}], [{"name": "blob", "port": BLOB, "protocol": "TCP"},
                                                         {"name": "upload", "port": UPLOAD, "protocol": "TCP"}])]


async def download(length: int, linger: float = 0.1) -> tuple[int, bytes]:
    """Ask blob for `length` bytes, wait `linger` before reading, read to EOF: (count, sha256)."""
    r, w = await asyncio.open_connection(VIP, BLOB)
    try:
        w.write(struct.pack("!Q", length))
        await w.drain()
        await asyncio.sleep(linger)
        h, n = hashlib.sha256(), 0
        while chunk := await r.read(MIB):
            h.update(chunk)
            n += len(chunk)
        return n, h.digest()
    finally:
        w.close()
        await w.wait_closed()


async def upload(length: int) -> tuple[int, bytes]:
    """Send `length` bytes and SHUT_WR; returns the (count, sha256) the server saw."""
    r, w = await asyncio.open_connection(VIP, UPLOAD)
    try:
        for part in pattern_chunks(length):
            w.write(part)
            await w.drain()
        w.write_eof()
        reply = await r.read(64)
        while len(reply) < 40 and (more := await r.read(64)):
            reply += more
        assert await r.read(1) == b""
        (count,) = struct.unpack("!Q", reply[32:40])
        return count, reply[:32]
    finally:
        w.close()
        await w.wait_closed()
