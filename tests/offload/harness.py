"""Netns harness for the nftables datapath tests: pods running idsrv, clients, and the datapath
programming the node namespace. Everything lives in the `topology` fixture's namespaces."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.netns import Topology, inside, nsexec

IDSRV = str(Path(__file__).with_name("idsrv.py"))
OFFLOAD = ("--offload", "nftables", "--offload-after", "1", "--min-sync-period", "200ms")  # agent flags


class Pods:
    """idsrv processes in pod namespaces; stopped by `close()` (and by Topology.close)."""

    def __init__(self, topo: Topology, tmp: Path) -> None:
        self.topo, self.tmp = topo, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stats: dict[str, Path] = {}

    def add(self, name: str, *addrs: str, port: int = 8080, mute: bool = False) -> str:
        ns = self.topo.add_host(name, *addrs)
        self.start(name, ns, port, mute=mute)
        return ns

    def start(self, name: str, ns: str, port: int, mute: bool = False) -> None:
        path = self.tmp / f"{name}-{port}.json"
        argv = ["ip", "netns", "exec", ns, sys.executable, IDSRV, name, str(port), str(path)]
        self.procs.append(subprocess.Popen(argv + (["--mute"] if mute else []), stdin=subprocess.DEVNULL))
        self.stats[f"{name}:{port}"] = path

    def counts(self, name: str, kind: str, port: int = 8080) -> dict[str, int]:
        path = self.stats[f"{name}:{port}"]
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return dict(json.loads(path.read_text())[kind])
        return {}

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def wait_listening(ns: str, addr: str, port: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with inside(ns):
            s = socket.socket()
        s.settimeout(0.5)
        try:
            s.connect((addr, port))
            s.recv(64)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            s.close()


def tcp_name(ns: str, addr: str, port: int, timeout: float = 3.0, src: str | None = None) -> str:
    """Connect from `ns` and return the name the endpoint sends (raises OSError on failure)."""
    with inside(ns):
        s = socket.socket()
    s.settimeout(timeout)
    try:
        if src:
            s.bind((src, 0))
        s.connect((addr, port))
        return s.recv(128).decode().split()[0]
    finally:
        s.close()


def tcp_peer_name(ns: str, addr: str, port: int, timeout: float = 3.0) -> tuple[str, str]:
    """Connect from `ns`; return (endpoint name, the client address the endpoint saw)."""
    with inside(ns):
        s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        name, peer = s.recv(128).decode().split()[:2]
        return name, peer
    finally:
        s.close()


def udp_socket(ns: str, src: tuple[str, int] = ("0.0.0.0", 0)) -> socket.socket:
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(src)
    return s


def hairpin_ports(topo: Topology) -> None:
    """Hairpin mode on every bridge port, as kubelet's hairpin-veth does for bridge CNIs: with
    br_netfilter, a pod's packet DNATed back to itself is bridged out of the port it came in."""
    for line in nsexec(topo.node, "ip", "-o", "link", "show", "master", "usbr0").stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        nsexec(topo.node, "ip", "link", "set", "dev", dev, "type", "bridge_slave", "hairpin", "on")


def nft_list(ns: str) -> str:
    return nsexec(ns, "nft", "list", "ruleset").stdout


def conntrack(ns: str, *args: str) -> str:
    return nsexec(ns, "conntrack", "-L", *args, check=False).stdout


def first(d: dict[str, Any]) -> Any:
    return next(iter(d.values()))
