"""Class "crash loop" (issue 18, item 4): with about 1,000 listeners open before the first
libnftables call, libnftables' select() aborted the agent ("bit out of range 0 - FD_SETSIZE"), on
every restart. NftClient creates its libnftables context (and netlink socket) when constructed,
which the agent does before it opens any listener: here a process builds the client, opens 1,100
sockets, then runs its first transactions, which must succeed. A subprocess, so an abort fails
this test instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.netns import Topology, nsexec

pytestmark = pytest.mark.netns

SCRIPT = textwrap.dedent("""
    import asyncio, resource, socket, sys
    from usproxy.offload.nftables.client import NftClient

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    client = NftClient(sys.argv[1])
    held = [socket.socket() for _ in range(1100)]
    print("highest", max(s.fileno() for s in held), flush=True)
    print("probe", client.probe(), flush=True)
    asyncio.run(client.run("add table ip usproxy-fds\\n"))
    print("listed", asyncio.run(client.list_table("ip", "usproxy-fds")) is not None, flush=True)
    client.close()
""")


def test_crash_loop_descriptors_above_fd_setsize_before_first_nft_call(topology: Topology) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-c", SCRIPT, topology.node], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert int(lines[0].split()[1]) >= 1100  # the test did put descriptors above FD_SETSIZE
    assert lines[1:] == ["probe libnftables", "listed True"]
    assert "usproxy-fds" in nsexec(topology.node, "nft", "list", "tables").stdout
