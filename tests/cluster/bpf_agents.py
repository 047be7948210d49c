"""Node agents with `--offload bpf` on the three-node cluster: each node's own pins and cgroup
(unique to the test, removed after), starting the agents, waiting until BPF carries every
ServicePort, and reading a node's tc conntrack tables (test_tc_nodeport, test_tc_dsr, test_xdp_maglev,
the hostile-network tests)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tests.cluster.cluster import Cluster
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader, nodeport
from usproxy.offload.bpf.layout import CT_MAPS, CtEntry
from usproxy.offload.pin_root import PIN_ROOT_ENV
from usproxy.util import cgroup2

CGROUP2 = cgroup2.mount_point()  # where this host mounts cgroup v2 (the agent's default --bpf-cgroup)


@contextlib.contextmanager
def node_dirs(tag: str) -> Iterator[dict[int, tuple[Path, Path]]]:
    """Per node: pins under /sys/fs/bpf and a cgroup, both unique to this test, removed after."""
    dirs = {i: (loader.BPFFS / f"usproxy-test-{tag}-n{i}", CGROUP2 / f"usproxy-test-{tag}-n{i}") for i in (1, 2, 3)}
    for _, cg in dirs.values():
        cg.mkdir()
    try:
        yield dirs
    finally:
        for pins, cg in dirs.values():
            loader.remove(loader.PinLayout(pins))
            with contextlib.suppress(OSError):
                cg.rmdir()


def ct_entries(pins: Path) -> list[CtEntry]:
    """Every tc conntrack entry (confirmed and not yet) in the pins at `pins`."""
    fds = {name: bpf.obj_get(str(loader.PinLayout(pins).maps / name)) for name in CT_MAPS}
    try:
        return nodeport.ct_entries(fds)
    finally:
        for fd in fds.values():
            os.close(fd)


async def served_by_bpf(c: Cluster, nodes: range, timeout: float = 60.0) -> None:
    """Wait until every ServicePort on `nodes` is carried by bpf, forwarded traffic included (an
    admin request that times out is asked again: at load 12 one took over 3 s)."""
    deadline = time.monotonic() + timeout
    for i in nodes:
        while True:
            try:
                rows = await asyncio.to_thread(c.admin, i, "/services")
            except OSError:
                rows = []
            if rows and all(r.get("datapath") == "bpf" and "userspace" not in r.get("reason", "") for r in rows):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"n{i} did not offload to bpf: {rows}\n{c.log(i)}")
            await asyncio.sleep(0.1)


class Agents:
    """Starts node agents with their pins and cgroup."""

    def __init__(self, c: Cluster, kc: Path, dirs: dict[int, tuple[Path, Path]]) -> None:
        self.c, self.kc, self.dirs = c, kc, dirs

    def flags(self, i: int) -> tuple[str, ...]:
        return ("--offload", "bpf", "--offload-after", "0.5", "--min-sync-period", "200ms",
                "--bpf-cgroup", str(self.dirs[i][1]))

    def env(self, i: int) -> dict[str, str]:
        return {PIN_ROOT_ENV: str(self.dirs[i][0])}

    def start(self, i: int) -> None:
        self.c.start_agent(i, self.kc, *self.flags(i), use_nsenter=True, env=self.env(i))
