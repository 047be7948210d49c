"""IPv6 in the test topology (tests/netns.py's Topology gives IPv4 only), for any datapath's tests.

`enable_ipv6` gives the node bridge NODE6 (fd00:244::1/64, forwarding on) and routes the ClusterIP
range fd00:96::/112 to the bridge without making it local (so a refusal can only come from the
datapath); `host6` makes a pod or client with an IPv4 address (add_host needs one for its default
route) and IPv6 addresses on the same /64 with a default route via the node. Every address is
added with `nodad`, so it is usable at once. `Responders` are the pods' servers: threads of this
process serving sockets created inside the pod namespaces, on both families
(tests/offload/idsrv.py listens on IPv4 only).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections import Counter

from tests.netns import Topology, inside, nsexec

__all__ = ["NODE6", "Responders", "enable_ipv6", "family_of", "host6", "tcp_id", "udp6"]

NODE6 = "fd00:244::1"


# -- topology -----------------------------------------------------------------------------------
def enable_ipv6(topo: Topology) -> None:
    n = topo.node
    nsexec(n, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    nsexec(n, "sysctl", "-qw", "net.ipv6.icmp.ratelimit=0")  # every refusal gets its ICMPv6 error
    # the bridge's link-local address is still tentative (DAD) for a second or two after it came
    # up, and until then the node cannot solicit its neighbours for forwarded packets: the first
    # packets to each endpoint would be lost. Replace it with one that skips DAD.
    for conf in ("all", "default", "usbr0"):
        nsexec(n, "sysctl", "-qw", f"net.ipv6.conf.{conf}.accept_dad=0")
    nsexec(n, "ip", "-6", "addr", "flush", "dev", "usbr0", "scope", "link")
    nsexec(n, "ip", "-6", "addr", "add", "fe80::1/64", "dev", "usbr0", "nodad")
    nsexec(n, "ip", "-6", "addr", "add", f"{NODE6}/64", "dev", "usbr0", "nodad")
    nsexec(n, "ip", "-6", "route", "add", "fd00:96::/112", "dev", "usbr0")


def host6(topo: Topology, short: str, v4: str, *v6: str) -> str:
    """A pod or client: `v4` (/16) and `v6` (the first /64, the others /128) on eth0."""
    ns = topo.add_host(short, v4)
    # as the node's bridge: a link-local address without DAD (fe80:: and the first one's interface id)
    nsexec(ns, "sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0")
    nsexec(ns, "ip", "-6", "addr", "flush", "dev", "eth0", "scope", "link")
    iid = int(ipaddress.IPv6Address(v6[0])) & ((1 << 64) - 1)
    nsexec(ns, "ip", "-6", "addr", "add", f"{ipaddress.IPv6Address((0xfe80 << 112) | iid)}/64", "dev", "eth0", "nodad")
    for i, a in enumerate(v6):
        nsexec(ns, "ip", "-6", "addr", "add", f"{a}/{64 if i == 0 else 128}", "dev", "eth0", "nodad")
    nsexec(ns, "ip", "-6", "route", "add", "default", "via", NODE6, "dev", "eth0")
    return ns


class Responders:
    """TCP and UDP servers on `port`, IPv4 and IPv6, for pods; one thread per socket.

    TCP: sends b"NAME <local address> <peer address>\\n" and closes. UDP: answers
    b"NAME|<peer address>|" + payload and counts the datagrams per NAME."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self.udp: Counter[str] = Counter()

    def start(self, ns: str, name: str, port: int = 8080) -> None:
        for fam, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                with inside(ns):
                    s = socket.socket(fam, kind)
                self.socks.append(s)
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((wildcard, port))
                s.settimeout(0.1)
                if kind == socket.SOCK_STREAM:
                    s.listen(256)
                t = threading.Thread(target=self._tcp if kind == socket.SOCK_STREAM else self._udp,
                                     args=(s, name), daemon=True)
                t.start()
                self.threads.append(t)

    def _tcp(self, s: socket.socket, name: str) -> None:
        while not self.stop.is_set():
            try:
                c, peer = s.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with c:
                try:
                    c.sendall(f"{name} {c.getsockname()[0]} {peer[0]}\n".encode())
                except OSError:
                    pass

    def _udp(self, s: socket.socket, name: str) -> None:
        while not self.stop.is_set():
            try:
                data, peer = s.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            self.udp[name] += 1
            try:
                s.sendto(f"{name}|{peer[0]}|".encode() + data, peer)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in self.socks:
            s.close()


def family_of(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def tcp_id(ns: str, addr: str, port: int, src: str | None = None, timeout: float = 3.0) -> tuple[str, str, str]:
    """Connect from `ns` (IPv4 or IPv6); (endpoint name, endpoint address, client address seen)."""
    with inside(ns):
        s = socket.socket(family_of(addr), socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        if src:
            s.bind((src, 0))
        s.connect((addr, port))
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
        name, local, peer = data.decode().split()
        return name, local, peer
    finally:
        s.close()


def udp6(ns: str, src: tuple[str, int] = ("::", 0)) -> socket.socket:
    with inside(ns):
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.bind(src)
    return s
