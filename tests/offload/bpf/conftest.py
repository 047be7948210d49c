"""Fixtures for the BPF socket-LB tests: a throwaway cgroup, pins and netns, removed whatever happens.

`bpf_env` gives a BpfDatapath attached to /sys/fs/cgroup/unified/usproxy-test-<random> (never the
root cgroup) with pins under /sys/fs/bpf/usproxy-test-<random>, plus the `topology` netns. Clients
run as subprocesses that join the test cgroup first and then enter their netns (`ip netns exec`
hides the cgroup filesystem). At the end: client processes killed, programs detached, pins
removed, the cgroup removed, and it is checked that nothing stayed attached.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.util import cgroup2

HERE = Path(__file__).parent
CGROUP2 = cgroup2.mount_point()  # where this host mounts cgroup v2 (the agent's default --bpf-cgroup)


def _kill_cgroup_procs(cg: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)


def _rmdir_cgroup(cg: Path) -> None:
    for _ in range(50):
        _kill_cgroup_procs(cg)
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    cg.rmdir()


def attached_programs(cg: Path) -> dict[str, list[int]]:
    """Program ids attached to `cg`, per hook."""
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return {prog: ids for prog, at in loader.PROGRAMS.items() if (ids := bpf.prog_query(fd, at))}
    finally:
        os.close(fd)


@pytest.fixture(scope="session", autouse=True)
def _bpffs_restored() -> Iterator[None]:
    """If these tests mounted bpffs at /sys/fs/bpf, it is unmounted again when empty."""
    if os.geteuid() != 0:
        yield
        return
    was = loader.mount_type(loader.BPFFS) == "bpf"
    yield
    preloaded = {"maps.debug", "progs.debug"}  # the kernel's bpf_preload iterators
    mine = [p for p in loader.BPFFS.iterdir() if p.name not in preloaded] if not was else []
    if not was and loader.mount_type(loader.BPFFS) == "bpf" and not mine:
        subprocess.run(["umount", str(loader.BPFFS)], check=False)


class Env:
    """One test's cgroup, pins, datapath and netns."""

    def __init__(self, topo: Topology, cgroup: Path, pin_root: Path) -> None:
        self.topo = topo
        self.cgroup = cgroup
        self.pin_root = pin_root
        self.dp = BpfDatapath(cgroup, pin_root)
        self.procs: list[subprocess.Popen[str]] = []
        self._clients: dict[str, str] = {}

    # -- netns ----------------------------------------------------------------------------
    def server(self, short: str, ip: str, *ports: int, extra: tuple[str, ...] = ()) -> str:
        """A pod netns with idsrv answering as `short` on `ports` (TCP and UDP)."""
        ns = self.topo.add_host(short, ip, *extra)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "idsrv.py"), short,
                                 *map(str, ports)], stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return ns

    def client_ns(self, short: str, ip: str) -> str:
        if short not in self._clients:
            self._clients[short] = self.topo.add_host(short, ip)
        return self._clients[short]

    def _argv(self, ns: str, *args: str, in_cgroup: bool = True) -> list[str]:
        script = (f"exec ip netns exec {ns} {sys.executable} {HERE / 'client.py'} " + " ".join(args))
        if in_cgroup:
            script = f"echo $$ > {self.cgroup}/cgroup.procs && {script}"
        return ["sh", "-c", script]

    def run(self, ns: str, *args: object, timeout: float = 120, in_cgroup: bool = True) -> dict[str, Any]:
        """Run client.py in the test cgroup (unless not `in_cgroup`) and netns `ns`; its JSON result."""
        argv = self._argv(ns, *map(str, args), in_cgroup=in_cgroup)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    def start(self, ns: str, *args: object, in_cgroup: bool = True) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self._argv(ns, *map(str, args), in_cgroup=in_cgroup), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def server_counts(self, ns_proc: subprocess.Popen[str]) -> dict[str, int]:
        ns_proc.terminate()
        out, _ = ns_proc.communicate(timeout=10)
        return dict(json.loads(out.strip().splitlines()[-1]))

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.communicate(timeout=5)


@pytest.fixture
def bpf_env(topology: Topology) -> Iterator[Env]:
    token = secrets.token_hex(4)
    cgroup = CGROUP2 / f"usproxy-test-{token}"
    pin_root = loader.BPFFS / f"usproxy-test-{token}"
    cgroup.mkdir()
    env = Env(topology, cgroup, pin_root)
    try:
        yield env
    finally:
        env.close()
        _kill_cgroup_procs(cgroup)
        env.dp.close()
        loader.remove(loader.PinLayout(pin_root))
        left = attached_programs(cgroup)
        _rmdir_cgroup(cgroup)
        assert not left, f"programs left attached: {left}"
        assert not pin_root.exists()


def nodeless(topo: Topology) -> None:
    """Nothing in netns node listens: traffic that works went straight to the pods."""
    out = nsexec(topo.node, "ss", "-tuanH").stdout
    assert out.strip() == "", out
