"""The guest is the node: its root network namespace runs the agent, network namespaces are its
pods and a client, as the tests on the host build them (tests/netns.py).

Layout: bridge br0 in the root namespace holds the pods' gateway 10.244.0.1/16 and the node
address 192.0.2.10/24 (NodePorts); pod namespaces pod-N (10.244.1.N/16, default route via the
bridge) and a client namespace (192.0.2.100/24, 10.96.0.0/16 routed to the node) hang off it on
veths. One process (servers.py) serves every pod: its sockets are made inside each pod's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

GUEST = Path(__file__).resolve().parent
OUT = Path("/lab/out")
NODE_IP = "192.0.2.10"
CLIENT_IP = "192.0.2.100"
CLIENT = "client"
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def sh(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), text=True, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc


def say(msg: str) -> None:
    """Progress on the console (the host streams it) and in scenario.log."""
    line = f"lab-guest: [{time.monotonic():7.1f}] {msg}"
    print(line, flush=True)
    with open("/dev/console", "w") as console:
        console.write(line + "\n")


@contextlib.contextmanager
def netns(name: str) -> Iterator[None]:
    """This thread inside netns `name` for the block: sockets made here belong to it."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
        yield
    finally:
        _libc.setns(original, CLONE_NEWNET)
        os.close(original)
        os.close(target)


def pod_ip(i: int) -> str:
    return f"10.244.1.{i + 10}"


def _veth(ns: str, host_side: str, address: str, *routes: tuple[str, str]) -> None:
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", host_side, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", host_side, "master", "br0", "up")
    sh("ip", "-n", ns, "addr", "add", address, "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    for dest, via in routes:
        sh("ip", "-n", ns, "route", "add", dest, "via", via)


def build(pods: int) -> list[str]:
    """Bridge, `pods` pod namespaces and the client; returns the pods' addresses."""
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
    sh("ip", "link", "add", "br0", "type", "bridge")
    sh("ip", "addr", "add", "10.244.0.1/16", "dev", "br0")
    sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", "br0")
    sh("ip", "link", "set", "br0", "up")
    for i in range(pods):
        _veth(f"pod-{i}", f"vpod{i}", f"{pod_ip(i)}/16", ("default", "10.244.0.1"))
    _veth(CLIENT, "vclient", f"{CLIENT_IP}/24", ("10.96.0.0/16", NODE_IP), ("10.244.0.0/16", NODE_IP))
    return [pod_ip(i) for i in range(pods)]


def start_servers(pods: int, tcp_ports: list[int], udp_ports: list[int]) -> subprocess.Popen[bytes]:
    """servers.py for every pod; returns once each pod's ports listen."""
    ready = OUT / "servers.ready"
    ready.unlink(missing_ok=True)
    log = (OUT / "servers.log").open("ab")
    proc = subprocess.Popen([sys.executable, str(GUEST / "servers.py"), str(pods), ",".join(map(str, tcp_ports)),
                             ",".join(map(str, udp_ports)), str(ready)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pod servers did not start: {(OUT / 'servers.log').read_text()[-800:]}")
        time.sleep(0.2)
    return proc


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
