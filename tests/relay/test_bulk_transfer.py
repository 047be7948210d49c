"""Bulk transfer: 256 MiB each way through the relay, intact, with memory bounded by backpressure.

Fault class: stream integrity and flow control on long transfers. Every byte arrives once and in
order (equal sha256 and length), in both directions at the same time, the FIN comes after the last
byte (C11 at its largest size), and a reader that falls behind makes the proxy stop reading from
the sender rather than buffer the stream: the agent's peak RSS (VmHWM) stays within 64 MiB of its
size before the transfer while the download client does not read for its first second.

Numbers: 256 MiB down (blob: write then close at once) and 256 MiB up (upload: SHUT_WR, then
sha256 and count back), run concurrently. Reduction: one transfer per direction instead of C11's
three.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.relay.case_c11 import BE, BLOB, UPLOAD, download, objects, upload
from tests.relay.harness import AgentProc, Backends, Manifests, vm_status
from tests.relay.tcp_clients import run_async, start_server
from tests.relay.tcp_servers import MIB, pattern_digest

pytestmark = pytest.mark.netns

SIZE = 256 * MIB


def test_256_mib_each_way(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    be = topology.add_host("bea", BE)
    start_server(backends, be, "blob", BE, str(BLOB))
    start_server(backends, be, "upload", BE, str(UPLOAD))
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    expected = (SIZE, pattern_digest(SIZE))
    try:
        agent.start()
        run_async(cli, lambda: download(MIB + 1))  # warm up buffers before the baseline
        before = vm_status(agent.pid(), "VmRSS")

        async def both() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
            return await asyncio.gather(download(SIZE, linger=1.0), upload(SIZE))

        down, up = run_async(cli, both)
        assert down == expected, f"download: {down[0]} bytes"
        assert up == expected, f"upload: {up[0]} bytes"
        peak = vm_status(agent.pid(), "VmHWM")
        assert peak - before < 64 * MIB, f"peak RSS {peak / MIB:.0f} MiB, before {before / MIB:.0f} MiB"
    finally:
        assert agent.stop() == 0
