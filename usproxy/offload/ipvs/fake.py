"""FakeIpvsKernel and FakeIpvsTools: IPVS, kube-ipvs0, ipsets and iptables in memory, for unit
tests without root (this project's machines have no IPVS at all; the real thing runs in the VM
lab, tests/offload/ipvs).

FakeIpvsKernel keeps virtual servers with real servers as the kernel's netlink interface does:
adding a service whose key exists fails EEXIST, deleting a missing one or a missing real server
ESRCH-like (ignored as IpvsKernel ignores them), a scheduler outside `schedulers` fails ENOENT;
`conns[(vs key, real key)]` is what a test sets as a real server's connections. Its ipset keeps
sets and entries as `ipset -exist restore` and `ipset save` do (every line of a restore checked
first, as the tool refuses a bad one before changing anything: a set to add to must exist, a
set in use by a rule cannot be destroyed). FakeIpvsTools is the iptables datapath's fake with
`unshare --net sh -c "ipset create ... && <restore>"` (the rules' probe) understood.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TypeVar

from usproxy.model.types import IPAddress
from usproxy.offload.iptables.fake import FakeIptablesClient
from usproxy.offload.ipvs.kernel import Dest, Service
from usproxy.util.errors import OffloadError

T = TypeVar("T")
VsKey = tuple[str, IPAddress, int]


class _SyncWorker:
    """NetnsWorker's interface, run inline."""

    def call(self, fn: Callable[..., T], *args: object, timeout: float | None = None) -> T:
        return fn(*args)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    def close(self) -> None:
        pass


class FakeIpvsKernel:
    """IpvsKernel in memory."""

    def __init__(self, *, loaded: bool = True, schedulers: Iterable[str] = ("rr", "lc", "wrr", "wlc", "sh"),
                 ipset_tool: bool = True) -> None:
        self.worker = _SyncWorker()
        self.device = "kube-ipvs0"
        self.is_loaded = loaded
        self.schedulers = set(schedulers)
        self.ipset_tool = ipset_tool
        self.services: dict[VsKey, Service] = {}
        self.reals: dict[VsKey, dict[tuple[IPAddress, int], Dest]] = {}
        self.conns: dict[tuple[VsKey, tuple[IPAddress, int]], int] = {}
        self.addresses: set[IPAddress] | None = None  # kube-ipvs0's; None: no device
        self.sets: dict[str, tuple[str, str, set[str]]] = {}  # name -> (type, header, members)
        self.restores: list[str] = []
        self.calls: list[str] = []
        self.fail_on: str | None = None  # a call name ("add_service", ...) that fails once

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    def _enter(self, what: str) -> None:
        """A call into the kernel: noted in `calls`, refused if it is `fail_on` or IPVS is not loaded."""
        self.calls.append(what)
        self._inject(what)
        if not self.is_loaded:
            raise OffloadError("IPVS: generic netlink family IPVS not found", errno.ENOENT)

    def _inject(self, what: str) -> None:
        if self.fail_on == what:
            self.fail_on = None
            raise OffloadError(f"IPVS {what}: injected failure", errno.EINVAL)

    # -- IPVS ---------------------------------------------------------------------------------------
    def loaded(self) -> bool:
        return self.is_loaded

    def installed(self) -> bool:
        return True  # a module to load (the probe says "not loaded", not "no IPVS")

    def dump(self) -> list[tuple[Service, list[Dest]]]:
        self._enter("dump")
        return [(s, self.dests(k)) for k, s in self.services.items()]

    def dests(self, key: VsKey) -> list[Dest]:
        return [replace(d, active=self.conns.get((key, d.key), 0)) for d in self.reals.get(key, {}).values()]

    def add_services(self, items: Sequence[tuple[Service, Sequence[Dest]]]) -> list[tuple[int, list[int]]]:
        """One netlink write: seen from outside as one step (`_enter` once), its messages run as
        the kernel runs them, each whatever the others' outcome (a real server of a virtual server
        that failed to be added fails too, or joins the one that exists)."""
        self._enter("add_services")
        return [(_code(self._new_service, s), [_code(self._new_dest, s.key, d) for d in dests]) for s, dests in items]

    def add_service(self, s: Service) -> None:
        self._enter("add_service")
        self._new_service(s)

    def _new_service(self, s: Service) -> None:
        self._inject("add_service")
        if s.key in self.services:
            raise OffloadError(f"IPVS add service {s.key}: File exists", errno.EEXIST)
        if s.scheduler not in self.schedulers:
            raise OffloadError(f"IPVS add service {s.key}: No such file or directory", errno.ENOENT)
        self.services[s.key], self.reals[s.key] = s, {}

    def edit_service(self, s: Service) -> None:
        self._enter("edit_service")
        if s.key not in self.services:
            raise OffloadError(f"IPVS edit service {s.key}: No such process", errno.ESRCH)
        self.services[s.key] = s

    def del_service(self, key: VsKey) -> None:
        self._enter("del_service")
        self.services.pop(key, None)
        self.reals.pop(key, None)

    def add_dest(self, key: VsKey, d: Dest) -> None:
        self._enter("add_dest")
        self._new_dest(key, d)

    def _new_dest(self, key: VsKey, d: Dest) -> None:
        self._inject("add_dest")
        if key not in self.services:
            raise OffloadError(f"IPVS add real server to {key}: No such process", errno.ESRCH)
        if d.key in self.reals[key]:
            raise OffloadError(f"IPVS add real server {d.key}: File exists", errno.EEXIST)
        self.reals[key][d.key] = d

    def edit_dest(self, key: VsKey, d: Dest) -> None:
        self._enter("edit_dest")
        if d.key not in self.reals.get(key, {}):
            raise OffloadError(f"IPVS edit real server {d.key}: No such process", errno.ESRCH)
        self.reals[key][d.key] = d

    def del_dest(self, key: VsKey, d: Dest) -> None:
        self._enter("del_dest")
        self.reals.get(key, {}).pop(d.key, None)

    # -- kube-ipvs0 ---------------------------------------------------------------------------------
    def ensure_device(self) -> int:
        if self.addresses is None:
            self.addresses = set()
        return 7

    def device_addresses(self) -> set[IPAddress] | None:
        return None if self.addresses is None else set(self.addresses)

    def bind(self, index: int, addrs: Iterable[IPAddress]) -> None:
        assert self.addresses is not None, "bind before the device exists"
        self.addresses |= set(addrs)

    def unbind(self, index: int, addrs: Iterable[IPAddress]) -> None:
        if self.addresses is not None:
            self.addresses -= set(addrs)

    def delete_device(self) -> bool:
        gone, self.addresses = self.addresses is not None, None
        return gone

    # -- ipset --------------------------------------------------------------------------------------
    def ipset(self, argv: list[str], stdin: str | None = None) -> str:
        if not self.ipset_tool:
            raise OffloadError("ipset: No such file or directory")
        if argv == ["--version"]:
            return "ipset v7.17, protocol version: 7\n"
        if argv == ["save"]:
            return self.save()
        if argv == ["-exist", "restore"]:
            self.restores.append(stdin or "")
            self.restore(stdin or "")
            return ""
        raise OffloadError(f"ipset: unexpected command {argv}")

    def save(self) -> str:
        out = []
        for name, (typ, header, members) in self.sets.items():
            out.append(f"create {name} {typ} {header} bucketsize 12 initval 0x1234abcd")
            out += [f"add {name} {m}" for m in sorted(members, reverse=True)]  # hash order: not sorted
        return "".join(line + "\n" for line in out)

    def restore(self, text: str) -> None:
        sets = {n: (t, h, set(m)) for n, (t, h, m) in self.sets.items()}
        for n, line in enumerate(text.splitlines(), start=1):
            words = line.split(" ", 2)
            if not line:
                continue
            verb, name = words[0], words[1]
            if verb == "create":
                typ, _, header = words[2].partition(" ")
                if name in sets and sets[name][0] != typ:
                    raise OffloadError(f"ipset v7.17: Error in line {n}: Set cannot be created: set with the "
                                       "same name already exists")
                sets.setdefault(name, (typ, header, set()))
            elif name not in sets:
                raise OffloadError(f"ipset v7.17: Error in line {n}: The set with the given name does not exist")
            elif verb == "add":  # an entry is its element; a comment rides along (and is updated)
                element = words[2].split(" comment ", 1)[0]
                sets[name][2].difference_update({m for m in sets[name][2] if m.split(" comment ", 1)[0] == element})
                sets[name][2].add(words[2])
            elif verb == "del":
                sets[name][2].difference_update({m for m in sets[name][2] if m.split(" comment ", 1)[0] == words[2]})
            elif verb == "flush":
                sets[name][2].clear()
            elif verb == "destroy":
                del sets[name]
            else:
                raise OffloadError(f"ipset v7.17: Error in line {n}: unknown command {verb}")
        self.sets = sets

    def members(self, name: str) -> set[str]:
        return set(self.sets[name][2]) if name in self.sets else set()

    def close(self) -> None:
        pass


class FakeIpvsTools(FakeIptablesClient):
    """The iptables fake, with the IPVS rules' probe (`unshare --net sh -c "ipset ... && restore"`)."""

    def __init__(self, backends: Sequence[str] = ("nft", "legacy"), *, v6: bool = True, socket_match: bool = True) -> None:
        super().__init__(backends, v6=v6)
        self.socket_match = socket_match

    def _run(self, argv: list[str], stdin: str | None) -> str:
        if argv[:4] == ["unshare", "--net", "sh", "-c"]:
            restore = argv[4].split(" && ", 1)[1].split()
            if not self.socket_match and "-m socket" in (stdin or ""):
                raise OffloadError("iptables-restore: line 9 failed: Couldn't load match `socket'")
            return super()._run(["unshare", "--net", *restore], stdin)
        return super()._run(argv, stdin)


def _code(fn: Callable[..., object], *args: object) -> int:
    try:
        fn(*args)
    except OffloadError as err:
        return err.errno or errno.EINVAL
    return 0


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


