"""Helpers shared by the UDP relay tests (C03, C05, C06, C08, C22, C23, DNS).

- `start_udpsrv()` runs tests/relay/udp_backends.py in a pod netns under a `Backends` owner, so
  `Backends.close()` stops it whatever happens.
- `client_socket()` makes a UDP socket that belongs to a client netns (created inside it, used
  from anywhere). `ask()` is one query on a fresh connected socket.
- `LimitedAgent` is an AgentProc started with a lower RLIMIT_NOFILE (soft and hard) through
  `prlimit --nofile=N:N`.
- `fd_count()` and `udp_flows()` read the agent's resources; `icmp_unlimited()` turns off the node's
  per-client ICMP rate limit (see its docstring for why the refusal cases need that).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.netns import Topology, inside, nsexec
from tests.relay.harness import AgentProc, Backends, Manifests

UDPSRV = str(Path(__file__).with_name("udp_backends.py"))


def start_udpsrv(backends: Backends, ns: str, name: str, addr: str, port: int,
                 log: Path | None = None, mute: bool = False) -> subprocess.Popen[bytes]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, UDPSRV, name, addr, str(port)]
    if log is not None:
        cmd += ["--log", str(log)]
    if mute:
        cmd.append("--mute")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    backends.procs.append(p)
    return p


def client_socket(ns: str, family: socket.AddressFamily = socket.AF_INET,
                  bind: tuple[str, int] | None = None, connect: tuple[str, int] | None = None,
                  timeout: float | None = 2.0) -> socket.socket:
    with inside(ns):
        s = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if bind is not None:
            s.bind(bind)
        if connect is not None:
            s.connect(connect)
        s.settimeout(timeout)
    except OSError:
        s.close()
        raise
    return s


def ask(ns: str, dst: tuple[str, int], payload: bytes, timeout: float = 2.0) -> bytes:
    """One datagram from a fresh connected socket; the answer (raises on timeout or refusal)."""
    family = socket.AF_INET6 if ":" in dst[0] else socket.AF_INET
    with client_socket(ns, family, connect=dst, timeout=timeout) as s:
        s.send(payload)
        return s.recv(65535)


def read_backend_log(path: Path) -> list[tuple[float, str, int, int, bytes]]:
    """(monotonic time, peer ip, peer port, length, first 16 bytes) per datagram a udpsrv got."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        t, ip, port, n, head = (line.split() + [""])[:5]
        out.append((float(t), ip, int(port), int(n), bytes.fromhex(head)))
    return out


class LimitedAgent(AgentProc):
    """An AgentProc started as `prlimit --nofile=N:N usproxy run ...` (prlimit execs the agent,
    so `pid()` is still the agent's)."""

    def __init__(self, topo: Topology, manifests: Manifests, loop: str, nofile: int, *extra: str) -> None:
        super().__init__(topo, manifests, loop, *extra)
        self.wrapper = ("prlimit", f"--nofile={nofile}:{nofile}")


def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def nofile_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' in limits")


def udp_flows(agent: AgentProc) -> list[dict[str, Any]]:
    return [f for f in agent.flows() if f["protocol"] == "UDP"]


def icmp_unlimited(topo: Topology) -> None:
    """Let the node answer every datagram to a closed port with ICMP port unreachable.

    Linux rate-limits ICMP errors per destination host (net.ipv4.icmp_ratelimit: 1 per second
    with a burst of 6; IPv6: net.ipv6.icmp.ratelimit). A sender at 20 datagrams/s would then see
    ECONNREFUSED on about 1 cycle in 20 whatever the proxy does (kube-proxy's REJECT rules are
    limited the same way). The refusal thresholds of C03/C22 measure whether the proxy leaves
    the refusing to the kernel, so the node netns runs with the limit off. The setting is per
    netns and dies with it.
    """
    nsexec(topo.node, "sysctl", "-qw", "net.ipv4.icmp_ratelimit=0")
    nsexec(topo.node, "sysctl", "-qw", "net.ipv6.icmp.ratelimit=0")
