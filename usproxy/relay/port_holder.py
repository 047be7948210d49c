"""PortHolder: which local socket (and process) holds a port the relay failed to bind.

Why the relay cannot take such a port (measured on Linux 6.18, this project's machines; the same
holds for every kernel since SO_REUSEPORT exists):
- TCP: while any socket listens on 0.0.0.0:P (or a dual-stack [::]:P), binding a ClusterIP:P
  fails with EADDRINUSE, with or without SO_REUSEADDR on either socket, and also with
  IP_TRANSPARENT on a non-local address. Only SO_REUSEPORT on both sockets of the same user
  lets the specific bind through (and the specific socket then gets the connections): a daemon
  that did not ask for it cannot be shared.
- UDP: the specific bind succeeds only with SO_REUSEADDR on both sockets (the specific socket
  then gets the datagrams). The relay sets no SO_REUSEADDR on UDP: with it, any local user
  could bind the very same ClusterIP:P and share its datagrams.
Since ClusterIPs are local addresses (VipInterface), the wildcard listener would then receive
the Service's traffic. kube-proxy 1.0 redirected in netfilter before the socket lookup, and so
does the relay (port_capture.py): the frontend is captured to a port of the relay's own, and the
holder named here is shown beside it in /services. Where no capture mechanism works, the relay
reports the port as failing (naming the holder) and retries, and takes the port as soon as the
holder lets it go.

`describe_holder` reads /proc/net/{tcp,udp}[6] of the caller's network namespace for the
holding socket's inode, then /proc/<pid>/fd for its process: O(processes x descriptors), a few
milliseconds on a node, so callers run it off the event loop and only when an error changes.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from usproxy.model.types import unmapped

TCP_LISTEN = "0A"  # include/net/tcp_states.h
PROC = Path("/proc")


def _address(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net address: IPv4 is one 32-bit word, IPv6 four, each in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def holding_sockets(addr: str, port: int, protocol: str, proc: Path = PROC) -> list[tuple[str, int]]:
    """(bound address text, socket inode) of every socket bound to `port` on `addr` or on a
    wildcard covering it (for an IPv4 `addr`, also [::], which is dual-stack unless V6ONLY: the
    kernel treats it as conflicting). TCP sockets count only when listening. `protocol` is "TCP"
    or "UDP"; unreadable tables count as empty."""
    want = ipaddress.ip_address(addr)
    name = protocol.lower()
    tables = [f"{name}6"] if want.version == 6 else [name, f"{name}6"]
    found = []
    for table in tables:
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            hexaddr, hexport = local.split(":")
            bound = unmapped(_address(hexaddr))  # a dual-stack socket bound to ::ffff:ClusterIP holds it
            if int(hexport, 16) != port or (protocol == "TCP" and state != TCP_LISTEN):
                continue
            if bound == want or bound.is_unspecified:
                found.append((str(bound), inode))
    return found


def socket_owner(inode: int, proc: Path = PROC) -> tuple[int, str] | None:
    """(pid, command name) of a process holding socket `inode`, or None when none is visible."""
    target = f"socket:[{inode}]"
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if target in _links(entry / "fd"):
                return int(entry.name), (entry / "comm").read_text().strip()
        except OSError:  # the process exited, or its descriptors are not ours to read
            continue
    return None


def _links(fd_dir: Path) -> set[str]:
    """Targets of a process's descriptors; one closed while being read is skipped."""
    out = set()
    with os.scandir(fd_dir) as fds:
        for fd in fds:
            try:
                out.add(os.readlink(fd.path))
            except OSError:
                continue
    return out


def describe_holder(addr: str, port: int, protocol: str, proc: Path = PROC) -> str:
    """Text naming what holds addr:port, e.g. "held by 0.0.0.0:2222 of pid 812 (sshd)", "held by
    0.0.0.0:10256 of this agent (pid 77)"; "" when no holding socket is found."""
    for bound, inode in holding_sockets(addr, port, protocol, proc):
        where = f"[{bound}]:{port}" if ":" in bound else f"{bound}:{port}"
        owner = socket_owner(inode, proc)
        if owner is None:
            return f"held by {where} (process not visible)"
        pid, comm = owner
        who = f"this agent (pid {pid})" if pid == os.getpid() else f"pid {pid} ({comm})"
        return f"held by {where} of {who}"
    return ""
