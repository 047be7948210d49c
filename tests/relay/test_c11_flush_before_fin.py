"""C11: a backend that writes and closes at once; the client must get every byte, both directions.

Fault class: EOF and flush ordering. A FIN (or close) from one side may only be passed on after
every byte buffered in the proxy for that direction has been written, whatever the sizes relative
to the proxy's buffers and high-water marks; and the memory used for buffering is given back.

Numbers as in the case: L in {0, 1, 65535, 65536, 65537, 1 MiB+1, 16 MiB}, downloads from `blob`
(8-byte length, L bytes, close at once) and uploads to `upload` (L bytes then SHUT_WR; sha256 and
count back), 16 streams at once, each download client waiting 100 ms before it reads; every
transfer must have length L and a matching sha256 (0 truncations); agent RSS back to baseline ±
8 MiB afterwards; 20 repeats per size and direction. Reduction: the 256 MiB transfers (3 per
direction in the case) are done once per direction, in test_bulk_transfer.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.netns import Topology
from tests.relay.case_c11 import BE, BLOB, SIZES, UPLOAD, download, objects, upload
from tests.relay.harness import AgentProc, Backends, Manifests
from tests.relay.tcp_clients import run_async, start_server, wait_until
from tests.relay.tcp_servers import MIB, pattern_digest

pytestmark = pytest.mark.netns

REPEATS = 20
STREAMS = 16


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


def test_every_byte_before_fin(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    be = topology.add_host("bea", BE)
    start_server(backends, be, "blob", BE, str(BLOB))
    start_server(backends, be, "upload", BE, str(UPLOAD))
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name)
    expected = {n: (n, pattern_digest(n)) for n in SIZES}
    try:
        agent.start()
        run_async(cli, lambda: download(MIB + 1))  # warm up buffers before the baseline
        baseline = vm_rss(agent.pid())

        async def run() -> list[tuple[str, int, tuple[int, bytes]]]:
            gate = asyncio.Semaphore(STREAMS)

            async def one(kind: str, n: int) -> tuple[str, int, tuple[int, bytes]]:
                async with gate:
                    return kind, n, await (download(n) if kind == "download" else upload(n))
            jobs = [one(kind, n) for _ in range(REPEATS) for n in SIZES for kind in ("download", "upload")]
            return await asyncio.gather(*jobs)

        results = run_async(cli, run)
        bad = [(kind, n, got[0]) for kind, n, got in results if got != expected[n]]
        assert not bad, f"{len(bad)} of {len(results)} transfers wrong (kind, L, received): {bad[:10]}"
        assert wait_until(lambda: not agent.flows(), 1.0)
        assert wait_until(lambda: vm_rss(agent.pid()) <= baseline + 8 * MIB, 2.0), \
            f"RSS {vm_rss(agent.pid()) / MIB:.1f} MiB, baseline {baseline / MIB:.1f} MiB"
    finally:
        assert agent.stop() == 0
