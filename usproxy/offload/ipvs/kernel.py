"""IpvsKernel: IPVS virtual and real servers over generic netlink, the kube-ipvs0 device, ipsets.

Every call runs in one worker thread (NetnsWorker: in the datapath's network namespace when one is
given), with pyroute2's IPVS and IPRoute sockets built there on a private selector loop (pyroute2's
synchronous API cannot run inside the agent's loop, and its asynchronous one fails under uvloop:
docs/platform.md). The ipset tool runs from that thread too (a child it forks starts in its
namespace). A failed call raises OffloadError with the kernel's errno.

Facts of the kernel's interface this relies on (net/netfilter/ipvs/ip_vs_ctl.c): adding or editing
a service needs the scheduler, flags, timeout and netmask attributes all present; the netmask of an
IPv6 service is a prefix length in the attribute's four bytes as the host orders them; the kernel
adds its own "hashed" flag (0x2) to every service; a real server's forwarding method 0 is Masq;
a service with no real server answers every new packet with ICMP port unreachable ("no destination
available"), so a new service and its first real server go in one write: generic netlink runs the
messages of one write one after the other in the same system call. New virtual servers with their
real servers, the bulk of a cold sync, go many to a write (messages.py), and dumps (a restart
reads back every virtual server's real servers) and kube-ipvs0's addresses are read with struct;
edits and deletes go through pyroute2, one request each.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from usproxy.model.node import interface_addresses
from usproxy.model.types import IPAddress
from usproxy.offload.ipvs import messages
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.util import netlink_batch
from usproxy.util.errors import OffloadError

PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": socket.IPPROTO_SCTP}
PROTOCOL_NAMES = {v: k for k, v in PROTOCOLS.items()}
MASQ = 0  # IP_VS_CONN_F_MASQ
FWD_MASK = 0x7
HASHED = 0x0002  # IP_VS_SVC_F_HASHED: the kernel's own
IFA_F_NODAD = 0x02


@dataclass(frozen=True, slots=True)
class Service:
    """One IPVS service as the kernel holds it (flags without the kernel's hashed bit)."""

    proto: str
    address: IPAddress
    port: int
    scheduler: str
    flags: int = 0
    timeout: int = 0

    @property
    def key(self) -> tuple[str, IPAddress, int]:
        return (self.proto, self.address, self.port)


@dataclass(frozen=True, slots=True)
class Dest:
    """One real server: address, port, weight, forwarding method; the kernel's connection counts."""

    address: IPAddress
    port: int
    weight: int = 1
    fwd: int = MASQ
    active: int = 0
    inactive: int = 0

    @property
    def key(self) -> tuple[IPAddress, int]:
        return (self.address, self.port)

    @property
    def connections(self) -> int:
        return self.active + self.inactive


def _netmask(family: int) -> str:
    """The netmask attribute as pyroute2 takes it: messages.netmask's four bytes in host order."""
    return socket.inet_ntoa(messages.netmask(family).to_bytes(4, sys.byteorder))


def _service_msg(s: Service) -> Any:
    from pyroute2 import IPVSService

    return IPVSService(af=socket.AF_INET if s.address.version == 4 else socket.AF_INET6,
                       protocol=PROTOCOLS[s.proto], addr=str(s.address), port=s.port, sched_name=s.scheduler,
                       flags={"flags": s.flags, "mask": 0xFFFFFFFF}, timeout=s.timeout,
                       netmask=_netmask(s.address.version))


def _key_msg(key: tuple[str, IPAddress, int]) -> Any:
    from pyroute2 import IPVSService

    proto, addr, port = key
    return IPVSService(af=socket.AF_INET if addr.version == 4 else socket.AF_INET6, protocol=PROTOCOLS[proto],
                       addr=str(addr), port=port)


def _dest_msg(d: Dest) -> Any:
    from pyroute2 import IPVSDest

    return IPVSDest(addr=str(d.address), port=d.port, weight=d.weight, fwd_method=d.fwd,
                    addr_family=socket.AF_INET if d.address.version == 4 else socket.AF_INET6)


def _service(parsed: tuple[int, IPAddress, int, str, int, int] | None) -> Service | None:
    """A dumped service; None for what usproxy never writes (fwmark services, unknown protocols)."""
    if parsed is None or parsed[0] not in PROTOCOL_NAMES:
        return None
    proto, address, port, scheduler, flags, timeout = parsed
    return Service(PROTOCOL_NAMES[proto], address, port, scheduler, flags & ~HASHED, timeout)


def _socket() -> socket.socket:
    """A generic netlink socket in the calling thread's network namespace, bound."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, netlink_batch.NETLINK_GENERIC)
    sock.bind((0, 0))
    return sock


def _errno(err: BaseException) -> int | None:
    code = getattr(err, "code", None)
    return code if isinstance(code, int) else None


class IpvsKernel:
    """IPVS and the dummy device of one network namespace (None: this process's)."""

    def __init__(self, netns: str | None = None, device: str = "kube-ipvs0") -> None:
        self.worker = NetnsWorker("ipvs", netns)
        self.device = device
        self._ipvs: Any = None
        self._ipr: Any = None
        self._loops: list[asyncio.AbstractEventLoop] = []  # the sockets' private loops, closed with them

    # -- in the worker thread ---------------------------------------------------------------------
    def _sock(self) -> Any:
        if self._ipvs is None:
            from pyroute2 import IPVS

            self._ipvs = IPVS(use_event_loop=self._loop())
        return self._ipvs

    def _ip(self) -> Any:
        if self._ipr is None:
            from pyroute2 import IPRoute

            self._ipr = IPRoute(use_event_loop=self._loop())
        return self._ipr

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.SelectorEventLoop()
        self._loops.append(loop)
        return loop

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as err:
            raise OffloadError(f"IPVS {what}: {err}", errno=_errno(err) or 0) from None

    def loaded(self) -> bool:
        """Whether ip_vs is loaded here (its /proc file exists in this thread's namespace)."""
        return os.path.exists("/proc/thread-self/net/ip_vs")

    def installed(self) -> bool:
        return module_installed()

    def dump(self) -> list[tuple[Service, list[Dest]]]:
        """Every address-based service with its real servers: one dump of the services, then one
        of each service's real servers, read with struct (messages.py) on one socket."""
        family = self._sock().prid
        with _socket() as sock:
            out = []
            for payload in self._dumped("dump", sock, messages.get_services(family, 1)):
                svc = _service(messages.parse_service(payload))
                if svc is not None:
                    out.append((svc, self._dests(sock, family, svc.key)))
            return out

    def dests(self, key: tuple[str, IPAddress, int]) -> list[Dest]:
        with _socket() as sock:
            return self._dests(sock, self._sock().prid, key)

    def _dests(self, sock: socket.socket, family: int, key: tuple[str, IPAddress, int]) -> list[Dest]:
        proto, addr, port = key
        request = messages.get_dests(family, 1, messages.service_key_attrs((PROTOCOLS[proto], addr, port)))
        found = (messages.parse_dest(p) for p in self._dumped(f"dump {key}", sock, request))
        return [Dest(a, p, w, fwd & FWD_MASK, act, inact) for a, p, w, fwd, act, inact in filter(None, found)]

    def _dumped(self, what: str, sock: socket.socket, request: bytes) -> list[bytes]:
        try:
            return netlink_batch.dump(sock, request)
        except OSError as err:
            raise OffloadError(f"IPVS {what}: {err}", errno=err.errno or 0) from None

    def add_services(self, items: Sequence[tuple[Service, Sequence[Dest]]]) -> list[tuple[int, list[int]]]:
        """New virtual servers, each followed by its real servers, many to a netlink write
        (messages.py, util/netlink_batch.py); per virtual server, its errno and its real servers'
        (0: added). A virtual server is never without its first real server while live traffic
        arrives: both go in one write, and the kernel runs them in the same system call."""
        family = self._sock().prid
        requests: list[Callable[[int], bytes]] = []
        for s, dests in items:
            key = (PROTOCOLS[s.proto], s.address, s.port)
            requests.append(partial(messages.new_service, family, service=messages.service_attrs(
                key, s.scheduler, s.flags, s.timeout)))
            named = messages.service_key_attrs(key)
            requests += [partial(messages.new_dest, family, key=named,
                                 dest=messages.dest_attrs(d.address, d.port, d.weight, d.fwd)) for d in dests]
        try:
            codes = iter(netlink_batch.requests(netlink_batch.NETLINK_GENERIC, requests))
        except OSError as err:
            raise OffloadError(f"IPVS add services: {err}", errno=err.errno or 0) from None
        return [(next(codes), [next(codes) for _ in dests]) for _, dests in items]

    def add_service(self, s: Service) -> None:
        """One virtual server without real servers (the probe's)."""
        (code, _), = self.add_services([(s, [])])
        if code:
            raise OffloadError(f"IPVS add service {s.key}: {os.strerror(code)}", errno=code)

    def edit_service(self, s: Service) -> None:
        self._call(f"edit service {s.key}", self._sock().service, "set", service=_service_msg(s))

    def del_service(self, key: tuple[str, IPAddress, int]) -> None:
        try:
            self._sock().service("del", service=_key_msg(key))
        except Exception as err:
            if _errno(err) not in (errno.ESRCH, errno.ENOENT):
                raise OffloadError(f"IPVS delete service {key}: {err}", errno=_errno(err) or 0) from None

    def add_dest(self, key: tuple[str, IPAddress, int], d: Dest) -> None:
        self._call(f"add real server {d.key} to {key}", self._sock().dest, "add", service=_key_msg(key),
                   dest=_dest_msg(d))

    def edit_dest(self, key: tuple[str, IPAddress, int], d: Dest) -> None:
        self._call(f"edit real server {d.key} of {key}", self._sock().dest, "set", service=_key_msg(key),
                   dest=_dest_msg(d))

    def del_dest(self, key: tuple[str, IPAddress, int], d: Dest) -> None:
        try:
            self._sock().dest("del", service=_key_msg(key), dest=_dest_msg(d))
        except Exception as err:
            if _errno(err) not in (errno.ESRCH, errno.ENOENT):
                raise OffloadError(f"IPVS delete real server {d.key} of {key}: {err}", errno=_errno(err) or 0) from None

    def ensure_device(self) -> int:
        """kube-ipvs0 as kube-proxy's EnsureDummyDevice: a dummy, left down; its index."""
        ipr = self._ip()
        found = ipr.link_lookup(ifname=self.device)
        if not found:
            self._call(f"create {self.device}", ipr.link, "add", ifname=self.device, kind="dummy")
            found = ipr.link_lookup(ifname=self.device)
        return int(found[0])

    def device_addresses(self) -> set[IPAddress] | None:
        """The addresses on kube-ipvs0 (one per ClusterIP IPVS serves), read with struct
        (model/node.py); None when it does not exist."""
        try:
            return interface_addresses(self.device)
        except OSError as err:
            raise OffloadError(f"read {self.device}'s addresses: {err}", errno=err.errno or 0) from None

    def bind(self, index: int, addrs: Iterable[IPAddress]) -> None:
        """Host addresses on kube-ipvs0, many to a netlink write; one already there counts as bound."""
        try:
            netlink_batch.add_addresses(index, list(addrs), IFA_F_NODAD)
        except OSError as err:
            raise OffloadError(f"bind to {self.device}: {err}", errno=err.errno or 0) from None

    def unbind(self, index: int, addrs: Iterable[IPAddress]) -> None:
        ipr = self._ip()
        for ip in addrs:
            try:
                ipr.addr("del", index=index, address=str(ip), prefixlen=32 if ip.version == 4 else 128)
            except Exception as err:
                if _errno(err) not in (errno.EADDRNOTAVAIL, errno.ENOENT, errno.ESRCH):
                    raise OffloadError(f"unbind {ip} from {self.device}: {err}", errno=_errno(err) or 0) from None

    def delete_device(self) -> bool:
        ipr = self._ip()
        found = ipr.link_lookup(ifname=self.device)
        if found:
            self._call(f"delete {self.device}", ipr.link, "del", index=found[0])
        return bool(found)

    def ipset(self, argv: list[str], stdin: str | None = None) -> str:
        """The ipset tool here (`ipset ARGV`); its stdout, OffloadError when it fails."""
        from usproxy.offload.iptables.client import run_command

        return run_command(["ipset", *argv], stdin)

    def close_sockets(self) -> None:
        for s in (self._ipvs, self._ipr):
            if s is not None:
                s.close()
        for loop in self._loops:  # one turn lets the closing transports finish, then the loop goes
            if not loop.is_closed():
                loop.run_until_complete(asyncio.sleep(0))
                loop.close()
        self._ipvs = self._ipr = None
        self._loops = []

    # -- from the event loop ----------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        return await self.worker.run(fn, *args)

    def close(self) -> None:
        try:
            self.worker.call(self.close_sockets, timeout=10)
        except Exception:
            pass
        self.worker.close()


def module_installed() -> bool:
    """Whether this kernel has an ip_vs module to load (modules.dep names it)."""
    try:
        with open(f"/lib/modules/{os.uname().release}/modules.dep") as f:
            return any("/ip_vs.ko" in line.split(":", 1)[0] for line in f)
    except OSError:
        return False
