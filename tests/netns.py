"""Throwaway network namespaces for datapath tests.

`Topology` builds the field-case layout: netns node (bridge usbr0 with 10.244.0.1/16 and the node
addresses 192.0.2.10/24, 192.0.2.11/24), one netns per pod (10.244.n.m on a veth into the bridge,
default route via node), client netns the same way, and 10.96.0.0/16 routed to node. Names carry a
random prefix so concurrent runs never collide; `close()` deletes everything, and the fixture calls
it whatever happened. `inside(ns)` runs a block with the calling thread in that namespace, so
sockets it creates belong there (setns is per thread).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from dataclasses import dataclass, field

from usproxy.util import netns as _netns

inside = _netns.inside  # tests import it from here


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, text=True, capture_output=True)


def nsexec(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", ns, *args, check=check)


@dataclass
class Topology:
    prefix: str = field(default_factory=lambda: "usp" + secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    node_addresses: tuple[str, ...] = ("192.0.2.10", "192.0.2.11")
    _veth: int = 0

    @property
    def node(self) -> str:
        return f"{self.prefix}-node"

    def ns(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        nsexec(name, "ip", "link", "set", "lo", "up")

    def build_node(self) -> None:
        self._add_ns(self.node)
        n = self.node
        nsexec(n, "ip", "link", "add", "usbr0", "type", "bridge")
        nsexec(n, "ip", "addr", "add", "10.244.0.1/16", "dev", "usbr0")
        for a in self.node_addresses:
            nsexec(n, "ip", "addr", "add", f"{a}/24", "dev", "usbr0")
        nsexec(n, "ip", "link", "set", "usbr0", "up")
        nsexec(n, "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def add_host(self, short: str, *addresses: str) -> str:
        """A pod or client netns with `addresses` (/16 each) on a veth into the node bridge."""
        name = self.ns(short)
        self._add_ns(name)
        self._veth += 1
        outer, inner = f"{self.prefix[-6:]}v{self._veth}", "eth0"
        nsexec(self.node, "ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
        nsexec(self.node, "ip", "link", "set", outer, "master", "usbr0", "up")
        # kubelet's hairpin-veth: a pod's connection DNATed back to itself leaves by its own port
        nsexec(self.node, "ip", "link", "set", "dev", outer, "type", "bridge_slave", "hairpin", "on")
        for i, a in enumerate(addresses):
            nsexec(name, "ip", "addr", "add", f"{a}/{16 if i == 0 else 32}", "dev", inner)
        nsexec(name, "ip", "link", "set", inner, "up")
        nsexec(name, "ip", "route", "add", "default", "via", "10.244.0.1")
        return name

    def close(self) -> None:
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "pids", name], capture_output=True)
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            sh("ip", "netns", "del", name, check=False)
        self.namespaces.clear()
