"""A three-node cluster in network namespaces, for tests that need more than one node.

```
 ext (203.0.113.10) ── lan (router: 203.0.113.1, 192.0.2.1; the fake API server on 192.0.2.1)
                          │ bridge lan0, 192.0.2.0/24
          ┌───────────────┼───────────────┐
   n1 192.0.2.11    n2 192.0.2.12    n3 192.0.2.13     nodes: `usproxy run --kubeconfig`, one each
   cbr0 10.244.1.1  cbr0 10.244.2.1  cbr0 10.244.3.1   pod bridges; each node routes the other
    pods 10.244.1.x  pods 10.244.2.x  pods 10.244.3.x   nodes' pod /24s via their 192.0.2.1N
```
Pods run tests/offload/idsrv.py (TCP: answers "NAME <peer ip>"). Every name is prefixed with a
random `usp…` tag, and `close()` deletes every namespace (killing what runs in it).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netns import inside, nsexec, sh
from tests.offload.harness import IDSRV
from tests.relay.harness import USPROXY

LAN, EXT = "192.0.2.1", "203.0.113.10"


def node_ip(i: int) -> str:
    return f"192.0.2.{10 + i}"


@dataclass
class Cluster:
    """Namespaces and processes of the three-node cluster; see the module docstring."""

    tmp: Path
    nodes: int = 3
    prefix: str = field(default_factory=lambda: "usp" + secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    agents: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    uplinks: dict[int, str] = field(default_factory=dict)  # node -> its veth's lan-side name
    fds: list[int] = field(default_factory=list)  # XDP links held open until close()
    _veth: int = 0

    def ns(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def node(self, i: int) -> str:
        return self.ns(f"n{i}")

    # -- topology --------------------------------------------------------------------------------
    def build(self) -> None:
        lan = self._add_ns("lan")
        nsexec(lan, "ip", "link", "add", "lan0", "type", "bridge")
        nsexec(lan, "ip", "addr", "add", f"{LAN}/24", "dev", "lan0")
        nsexec(lan, "ip", "link", "set", "lan0", "up")
        nsexec(lan, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        ext = self._add_ns("ext")
        self._link(lan, ext, "203.0.113.1/24", f"{EXT}/24", "203.0.113.1")
        for i in range(1, self.nodes + 1):
            n = self._add_ns(f"n{i}")
            outer = self._veth_pair(lan, n)
            self.uplinks[i] = outer
            nsexec(lan, "ip", "link", "set", outer, "master", "lan0", "up")
            nsexec(n, "ip", "addr", "add", f"{node_ip(i)}/24", "dev", "eth0")
            nsexec(n, "ip", "link", "set", "eth0", "up")
            nsexec(n, "ip", "route", "add", "default", "via", LAN)
            nsexec(n, "ip", "link", "add", "cbr0", "type", "bridge")
            nsexec(n, "ip", "addr", "add", f"10.244.{i}.1/24", "dev", "cbr0")
            nsexec(n, "ip", "link", "set", "cbr0", "up")
            nsexec(n, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            for j in range(1, self.nodes + 1):
                if j != i:
                    nsexec(n, "ip", "route", "add", f"10.244.{j}.0/24", "via", node_ip(j))
                    nsexec(lan, "ip", "route", "replace", f"10.244.{j}.0/24", "via", node_ip(j))

    def add_pod(self, node: int, name: str, ip: str, port: int = 8080, serve: bool = True) -> str:
        """A pod netns `name` with `ip`/24 behind node `node`'s cbr0, running idsrv unless told."""
        pod = self._add_ns(name)
        outer = self._veth_pair(self.node(node), pod)
        nsexec(self.node(node), "ip", "link", "set", outer, "master", "cbr0", "up")
        nsexec(pod, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        nsexec(pod, "ip", "link", "set", "eth0", "up")
        nsexec(pod, "ip", "route", "add", "default", "via", f"10.244.{node}.1")
        if serve:
            stats = self.tmp / f"{name}.json"
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", pod, sys.executable, IDSRV, name, str(port), str(stats)],
                                               stdin=subprocess.DEVNULL))
        return pod

    # -- agents ----------------------------------------------------------------------------------
    def start_agent(self, i: int, kubeconfig: Path, *flags: str, use_nsenter: bool = False,
                    env: dict[str, str] | None = None) -> None:
        """`usproxy run` on node i, named node-i, against `kubeconfig`; returns once it synced.
        `use_nsenter` enters only the node's network namespace (BPF agents: `ip netns exec`
        remounts /sys, hiding bpffs and cgroup2); `env` is added to the agent's environment."""
        log = (self.tmp / f"agent-n{i}.log").open("ab")
        enter = ["nsenter", f"--net=/run/netns/{self.node(i)}"] if use_nsenter else ["ip", "netns", "exec", self.node(i)]
        self.agents[i] = subprocess.Popen(
            [*enter, USPROXY, "-v", "run", "--kubeconfig", str(kubeconfig),
             "--hostname-override", f"node-{i}", "--healthz-bind-address", "127.0.0.1:10256",
             "--metrics-bind-address", "127.0.0.1:10249", *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        log.close()
        deadline = time.monotonic() + 60  # until synced; at load 12 the first sync took longer than 15 s
        while time.monotonic() < deadline:
            if self.agents[i].poll() is not None:
                raise RuntimeError(f"agent n{i} exited:\n{self.log(i)}")
            with contextlib.suppress(OSError):
                if not self.admin(i, "/healthz", 10256)["lastUpdated"].startswith("0001-"):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"agent n{i} did not sync:\n{self.log(i)}")

    def uplink_xdp(self, i: int) -> None:
        """An XDP program that passes everything at the lan side of node i's eth0, as the wire of
        a NIC would take every frame: a veth wakes its peer's NAPI for frames sent with XDP_TX
        only when the peer runs an XDP program (drivers/net/veth.c veth_xdp_flush; GRO alone
        leaves them unpolled in the ring, see uplink_gro). The program is usproxy's own on fresh,
        empty maps: it passes every packet."""
        from usproxy.offload.bpf import libbpf as bpf
        from usproxy.offload.bpf.build import object_path

        obj = bpf.BpfObject(str(object_path()))
        try:
            obj.load()
            with inside(self.ns("lan")):
                self.fds.append(bpf.xdp_link_create(obj.prog_fd("usp_xdp"), socket.if_nametoindex(self.uplinks[i])))
        finally:
            obj.close()

    def uplink_gro(self, i: int) -> None:
        """GRO on the lan side of node i's eth0: the peer gets a NAPI (xdp-features NDO_XMIT on
        eth0) but no XDP program, the case where XDP_TX frames are queued and never polled."""
        with inside(self.ns("lan")):
            ethtool_set(self.uplinks[i], ETHTOOL_SGRO, True)

    def wire_checksums(self, ns: str) -> None:
        """Complete checksums from `ns`'s sockets (tx checksum offload off on its eth0), as every
        frame from a wire has: a veth hands XDP a local sender's partial checksum, which xdp_lb.h
        leaves to tc (it cannot complete one), so a lab whose senders offload would see XDP serve
        nothing of their traffic."""
        with inside(ns):
            ethtool_set("eth0", ETHTOOL_STXCSUM, False)

    def stop_agent(self, i: int, sig: int = signal.SIGTERM) -> int:
        p = self.agents.pop(i)
        p.send_signal(sig)
        try:
            return p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()

    def admin(self, i: int, path: str, port: int = 10249) -> Any:
        with inside(self.node(i)), urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return json.load(r)

    def log(self, i: int) -> str:
        path = self.tmp / f"agent-n{i}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def close(self) -> None:
        for i in list(self.agents):
            with contextlib.suppress(Exception):
                self.stop_agent(i)
        for p in self.procs:
            p.kill()
            p.wait()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        for name in reversed(self.namespaces):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
        self.namespaces.clear()

    # -- plumbing --------------------------------------------------------------------------------
    def _add_ns(self, short: str) -> str:
        name = self.ns(short)
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        nsexec(name, "ip", "link", "set", "lo", "up")
        return name

    def _veth_pair(self, outer_ns: str, inner_ns: str) -> str:
        """A veth from `outer_ns` (returned name) to eth0 in `inner_ns`."""
        self._veth += 1
        outer = f"{self.prefix[-6:]}v{self._veth}"
        nsexec(outer_ns, "ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", inner_ns)
        return outer

    def _link(self, a: str, b: str, a_addr: str, b_addr: str, b_gateway: str) -> None:
        outer = self._veth_pair(a, b)
        nsexec(a, "ip", "addr", "add", a_addr, "dev", outer)
        nsexec(a, "ip", "link", "set", outer, "up")
        nsexec(b, "ip", "addr", "add", b_addr, "dev", "eth0")
        nsexec(b, "ip", "link", "set", "eth0", "up")
        nsexec(b, "ip", "route", "add", "default", "via", b_gateway)


SIOCETHTOOL, ETHTOOL_STXCSUM, ETHTOOL_SGRO = 0x8946, 0x00000017, 0x0000002c


def ethtool_set(ifname: str, cmd: int, on: bool) -> None:
    """`ethtool -K IFNAME <feature> on|off` in the current netns (SIOCETHTOOL: no ethtool here)."""
    value = ctypes.create_string_buffer(struct.pack("=II", cmd, int(on)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, struct.pack("16sP", ifname.encode(), ctypes.addressof(value)))


ETHTOOL_GDRVINFO, ETHTOOL_GSTRINGS, ETHTOOL_GSTATS, ETH_SS_STATS, ETH_GSTRING_LEN = 0x3, 0x1b, 0x1d, 1, 32


def ethtool_stats(ifname: str) -> dict[str, int]:
    """`ethtool -S IFNAME` in the current netns (a veth's: rx_queue_0_xdp_tx, peer_tq_0_xdp_xmit_errors,
    ...; SIOCETHTOOL GDRVINFO for the count, then GSTRINGS and GSTATS, include/uapi/linux/ethtool.h)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        def ask(buf: ctypes.Array[ctypes.c_char]) -> bytes:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, struct.pack("16sP", ifname.encode(), ctypes.addressof(buf)))
            return buf.raw

        info = ask(ctypes.create_string_buffer(struct.pack("=I", ETHTOOL_GDRVINFO), 196))
        n = struct.unpack_from("=I", info, 180)[0]
        raw = ask(ctypes.create_string_buffer(struct.pack("=III", ETHTOOL_GSTRINGS, ETH_SS_STATS, n), 12 + n * ETH_GSTRING_LEN))
        names = [raw[12 + i * ETH_GSTRING_LEN:12 + (i + 1) * ETH_GSTRING_LEN].split(b"\0")[0].decode() for i in range(n)]
        values = struct.unpack_from(f"={n}Q", ask(ctypes.create_string_buffer(struct.pack("=II", ETHTOOL_GSTATS, n), 8 + 8 * n)), 8)
        return dict(zip(names, values))
