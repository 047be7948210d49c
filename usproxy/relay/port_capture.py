"""PortCapture: frontends whose port a local socket holds, captured for the relay ahead of the
kernel's socket lookup (issue 29 item 6).

Why: ClusterIPs are local addresses, so a node daemon listening on 0.0.0.0:P (or [::]:P) makes
the relay's bind of ClusterIP:P fail (port_holder.py says why no socket option helps), and the
kernel's socket lookup then hands the Service's connections to the daemon. kube-proxy, even
1.0's userspace mode, redirected in netfilter, before that lookup. So does this: a frontend
whose bind fails with EADDRINUSE gets a listener of its own on the same address and a port the
kernel picks (Q), and a DNAT from address:P to address:Q in the nat hooks (prerouting for
forwarded traffic, output for the node's own), which run before the lookup. DNAT to the
frontend's own address rather than 1.0's REDIRECT (to the interface's primary address, or
127.0.0.1 for the node's own traffic, with the proxy on a wildcard port): the relay's port is
reachable only through the frontend address, and the listener keeps the frontend's
loadBalancerSourceRanges filter. Each captured frontend has its own listener, so the socket that
receives a connection names its original destination (SO_ORIGINAL_DST would tell the same);
replies leave from address:Q and conntrack's reverse NAT gives them back address:P, UDP's too.
A captured frontend whose Service loses its endpoints is *refused* instead (TCP reset, ICMP port
unreachable in the filter input hook, also before the lookup), as kube-proxy rejects and as the
relay's closed port would, never handed to the holder; so is a frontend without endpoints whose
port is found held when its Service changes (`held`).

Mechanisms, chosen once by probing the running kernel (`choose`; `--relay-capture` forces one):
- `nftables`: tables `ip usproxy-capture` and `ip6 usproxy-capture`, a map of captured frontends
  (address . protocol . port : address . port) used by `dnat` in nat prerouting and output at
  priority -99 (after the nftables offload's DNAT at -100, so an offloaded frontend keeps the
  kernel path and only what the relay serves is captured), a set of refused frontends;
- `iptables`: chains USPROXY-CAPTURE (nat, jumped to from PREROUTING and OUTPUT) and
  USPROXY-CAPTURE-REFUSE (filter INPUT), for kernels without nf_tables (iptables-legacy), as
  kube-proxy 1.0 did;
Each change rewrites the whole (small) ruleset in one atomic step (`nft -f`, `iptables-restore
--noflush` of our chains), so the first write after a restart replaces what the previous agent
left; until then its rules refuse (their ports are closed), never hand the frontend to the
holder. A BPF sk_lookup program would serve TCP on kernels without netfilter NAT but not UDP
(a reply must leave from port P, which the holder keeps); it is not implemented.

The kernel calls run as commands (util/command.py: started with vfork, waited for in a worker
thread; nothing blocks the loop; the relay imports no other datapath). Where no mechanism works,
a held frontend is reported as before (port_holder.py) with the reason capture is unavailable.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from usproxy.util.command import output, run

log = logging.getLogger(__name__)

CaptureMode = Literal["auto", "nftables", "iptables", "none"]
CAPTURE_MODES: tuple[CaptureMode, ...] = ("auto", "nftables", "iptables", "none")
TABLE = "usproxy-capture"
NAT_CHAIN, REFUSE_CHAIN = "USPROXY-CAPTURE", "USPROXY-CAPTURE-REFUSE"
IP_FREEBIND, IPV6_FREEBIND = 15, 78  # linux/in.h, linux/in6.h
Frontend = tuple[str, int, str]  # (address, port, protocol)


def family_of(addr: str) -> int:
    return 6 if ":" in addr else 4


def port_held(addr: str, port: int, protocol: str) -> bool:
    """Whether another socket holds `port` so that addr:port cannot be bound (EADDRINUSE).
    Binds and closes a throwaway socket (IP_FREEBIND: the address need not be local yet)."""
    v6 = family_of(addr) == 6
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET,
                         socket.SOCK_STREAM if protocol == "TCP" else socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, IPV6_FREEBIND if v6 else IP_FREEBIND, 1)
        if v6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        return False
    except OSError as err:
        return err.errno == errno.EADDRINUSE
    finally:
        sock.close()


@dataclass(frozen=True, slots=True)
class Rules:
    """What is captured: frontend -> the relay's port on the same address, and what is refused."""

    captured: tuple[tuple[Frontend, int], ...] = ()
    refused: tuple[Frontend, ...] = ()

    def of_family(self, family: int) -> Rules:
        return Rules(tuple((f, q) for f, q in self.captured if family_of(f[0]) == family),
                     tuple(f for f in self.refused if family_of(f[0]) == family))


def nft_script(rules: Rules) -> str:
    """One `nft -f` transaction that replaces both families' capture tables by `rules`."""
    out = []
    for family, fam, addr_t in ((4, "ip", "ipv4_addr"), (6, "ip6", "ipv6_addr")):
        mine = rules.of_family(family)
        out += [f"add table {fam} {TABLE}", f"delete table {fam} {TABLE}", f"add table {fam} {TABLE}",
                f"add map {fam} {TABLE} captured {{ type {addr_t} . inet_proto . inet_service : {addr_t} . inet_service; }}",
                f"add set {fam} {TABLE} refused {{ type {addr_t} . inet_proto . inet_service; }}"]
        for hook in ("prerouting", "output"):
            out += [f"add chain {fam} {TABLE} {hook} {{ type nat hook {hook} priority -99; policy accept; }}",
                    f"add rule {fam} {TABLE} {hook} meta l4proto {{ tcp, udp }} "
                    f"dnat {fam} to {fam} daddr . meta l4proto . th dport map @captured"]
        out += [f"add chain {fam} {TABLE} input {{ type filter hook input priority -1; policy accept; }}",
                f"add rule {fam} {TABLE} input meta l4proto tcp {fam} daddr . meta l4proto . th dport @refused "
                "reject with tcp reset",
                f"add rule {fam} {TABLE} input meta l4proto udp {fam} daddr . meta l4proto . th dport @refused reject"]
        caps = [f"{a} . {p.lower()} . {port} : {a} . {q}" for (a, port, p), q in mine.captured]
        if caps:
            out.append(f"add element {fam} {TABLE} captured {{ {', '.join(caps)} }}")
        refs = [f"{a} . {p.lower()} . {port}" for a, port, p in mine.refused]
        if refs:
            out.append(f"add element {fam} {TABLE} refused {{ {', '.join(refs)} }}")
    return "\n".join(out) + "\n"


def nft_delete_script() -> str:
    return "".join(f"add table {fam} {TABLE}\ndelete table {fam} {TABLE}\n" for fam in ("ip", "ip6"))


def iptables_input(rules: Rules, family: int) -> str:
    """iptables-restore --noflush input that replaces our two chains' rules by `rules` (the jumps
    to them are ensured separately: restore cannot add a jump only when it is missing)."""
    mine = rules.of_family(family)
    host = "/32" if family == 4 else "/128"
    udp_reject = "icmp-port-unreachable" if family == 4 else "icmp6-port-unreachable"
    nat = [f"-A {NAT_CHAIN} -d {a}{host} -p {p.lower()} -m {p.lower()} --dport {port} -j DNAT "
           f"--to-destination {a if family == 4 else '[' + a + ']'}:{q}" for (a, port, p), q in mine.captured]
    refuse = [f"-A {REFUSE_CHAIN} -d {a}{host} -p {p.lower()} -m {p.lower()} --dport {port} -j REJECT --reject-with "
              f"{'tcp-reset' if p == 'TCP' else udp_reject}" for a, port, p in mine.refused]
    return "\n".join(["*nat", f":{NAT_CHAIN} - [0:0]", f"-F {NAT_CHAIN}", *nat, "COMMIT",
                      "*filter", f":{REFUSE_CHAIN} - [0:0]", f"-F {REFUSE_CHAIN}", *refuse, "COMMIT"]) + "\n"


JUMPS = (("nat", "PREROUTING", NAT_CHAIN), ("nat", "OUTPUT", NAT_CHAIN), ("filter", "INPUT", REFUSE_CHAIN))


class PortCapture:
    """The capture state of the relay and the mechanism that carries it out (`mode`: one of
    nftables, iptables, or none once `choose` found nothing, with `why`)."""

    def __init__(self, wanted: CaptureMode = "auto") -> None:
        self.wanted = wanted
        self.mode: CaptureMode | None = None  # chosen at `start`
        self.why = ""
        self.captured: dict[Frontend, int] = {}
        self.refused: set[Frontend] = set()
        self._iptables: dict[int, str] = {}  # family -> the iptables command that works
        self._lock = asyncio.Lock()
        self._written = False
        self._probe: asyncio.Task[None] | None = None
        self._settle: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        return self.mode in ("nftables", "iptables")

    def can(self, addr: str) -> bool:
        """Whether frontends of `addr`'s family can be captured here."""
        return self.mode == "nftables" or (self.mode == "iptables" and family_of(addr) in self._iptables)

    def start(self) -> None:
        """Probe the mechanisms in the background (a few subprocesses: they must not delay the
        first sync of every agent, most of which never capture); `ready()` waits for it."""
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._choose())

    async def _choose(self) -> None:
        self.mode, self.why = await choose(self.wanted, self._iptables)
        log.info("relay capture of held frontends: %s (%s)", self.mode, self.why)

    async def ready(self) -> None:
        """Wait for the probe (`start` first)."""
        self.start()
        assert self._probe is not None
        await asyncio.shield(self._probe)

    def settle(self) -> None:
        """After the first sync, in the background: when nothing was captured, remove what a
        previous agent left (rules to its ports, closed now: they refuse until then); when
        something was, the first write replaced it already."""
        if self._settle is None:
            self._settle = asyncio.get_running_loop().create_task(self._settle_leftovers())

    async def _settle_leftovers(self) -> None:
        await self.ready()
        async with self._lock:
            if self._written:
                return
            if self.mode != "nftables" or await _nft_table_exists() or await _iptables_chain_exists():
                await self._remove_leftovers()

    async def close(self) -> None:
        """The agent's exit: stop the background work; the rules stay (see the module docstring)."""
        tasks = [t for t in (self._probe, self._settle) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def capture(self, frontend: Frontend, to_port: int) -> None:
        """Send `frontend`'s new connections to the relay's port `to_port` on its address.
        Raises OSError when the kernel refuses (the caller reports the frontend as held)."""
        self.captured[frontend] = to_port
        self.refused.discard(frontend)
        await self._write_or_undo(lambda: self.captured.pop(frontend, None))

    async def refuse(self, frontend: Frontend) -> None:
        """Refuse `frontend`'s new connections (no relay listener, the port held by another)."""
        if frontend in self.refused and frontend not in self.captured:
            return
        self.captured.pop(frontend, None)
        self.refused.add(frontend)
        await self._write_or_undo(lambda: self.refused.discard(frontend))

    async def release(self, frontends: Iterable[Frontend]) -> None:
        """Neither capture nor refuse these any more."""
        gone = [f for f in frontends if f in self.captured or f in self.refused]
        if not gone:
            return
        for f in gone:
            self.captured.pop(f, None)
            self.refused.discard(f)
        try:
            await self._write()
        except OSError as err:
            log.error("relay capture: %s", err)

    async def _write_or_undo(self, undo: object) -> None:
        try:
            await self._write()
        except BaseException:
            if callable(undo):
                undo()
            raise

    async def _write(self) -> None:
        rules = Rules(tuple(sorted(self.captured.items())), tuple(sorted(self.refused)))
        async with self._lock:
            if self.mode == "nftables":
                code, err = await run(["nft", "-f", "-"], nft_script(rules))
                if code:
                    raise OSError(errno.EIO, f"nft: {err}")
            elif self.mode == "iptables":
                for family, cmd in self._iptables.items():
                    code, err = await run([f"{cmd}-restore", "--noflush"], iptables_input(rules, family))
                    if code:
                        raise OSError(errno.EIO, f"{cmd}-restore: {err}")
                    if not await _ensure_jumps(cmd):
                        raise OSError(errno.EIO, f"{cmd}: cannot add the jumps to {NAT_CHAIN} and {REFUSE_CHAIN}")
            else:
                raise OSError(errno.EOPNOTSUPP, f"no capture here: {self.why}")
            self._written = True

    async def _remove_leftovers(self) -> None:
        if shutil.which("nft"):
            await run(["nft", "-f", "-"], nft_delete_script())
        await remove_iptables()

    async def cleanup(self) -> None:
        """Remove every capture rule, of either mechanism (`usproxy run --cleanup`)."""
        await self._remove_leftovers()


async def _nft_table_exists() -> bool:
    """Whether an earlier agent left a capture table (either family); one `nft list tables`."""
    if not shutil.which("nft"):
        return False
    return TABLE in await output(["nft", "list", "tables"])


async def _iptables_chain_exists() -> bool:
    """Whether an earlier agent in iptables mode left its nat chain (IPv4; one iptables-save)."""
    if not shutil.which("iptables-save"):
        return False
    return NAT_CHAIN in await output(["iptables-save", "-t", "nat"])


async def remove_iptables() -> None:
    """Delete our chains and the jumps to them, in every iptables command that has them."""
    for base in ("iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy"):
        if not shutil.which(base):
            continue
        for table, parent, chain in JUMPS:
            while (await run([base, "-w", "-t", table, "-D", parent, "-j", chain]))[0] == 0:
                pass
        for table, chain in (("nat", NAT_CHAIN), ("filter", REFUSE_CHAIN)):
            await run([base, "-w", "-t", table, "-F", chain])
            await run([base, "-w", "-t", table, "-X", chain])


async def choose(wanted: CaptureMode, iptables: dict[int, str]) -> tuple[CaptureMode, str]:
    """The mechanism to use and why: the first of nftables, iptables that works here (the one
    asked for, when not auto), or none."""
    if wanted == "none":
        return "none", "--relay-capture none"
    tried = []
    if wanted in ("auto", "nftables"):
        why = await probe_nftables()
        if not why:
            return "nftables", "nat hooks, maps and reject in table usproxy-capture"
        tried.append(f"nftables: {why}")
    if wanted in ("auto", "iptables"):
        why = await probe_iptables(iptables)
        if not why:
            return "iptables", f"DNAT and REJECT through {', '.join(sorted(set(iptables.values())))}"
        tried.append(f"iptables: {why}")
    return "none", "; ".join(tried)


async def probe_nftables() -> str:
    """"" when this kernel takes the capture tables (checked with `nft -c`: nothing is
    installed), else why not."""
    if not shutil.which("nft"):
        return "no nft command"
    probe = Rules(((("127.0.0.9", 9, "TCP"), 9), (("::9", 9, "UDP"), 9)), (("127.0.0.9", 9, "UDP"),))
    code, err = await run(["nft", "-c", "-f", "-"], nft_script(probe))
    return f"nft -c: {err.splitlines()[0] if err else code}" if code else ""


async def probe_iptables(found: dict[int, str]) -> str:
    """"" when iptables (or iptables-legacy, on a kernel without nf_tables) takes our chains, per
    family (checked with restore's --test: nothing is installed); fills `found` with the command
    that works."""
    why = []
    for family, names in ((4, ("iptables", "iptables-legacy")), (6, ("ip6tables", "ip6tables-legacy"))):
        for cmd in names:
            if not shutil.which(cmd) or not shutil.which(f"{cmd}-restore"):
                continue
            addr = "127.0.0.9" if family == 4 else "::9"
            probe = Rules((((addr, 9, "TCP"), 9),), ((addr, 9, "UDP"),))
            code, err = await run([f"{cmd}-restore", "--noflush", "--test"], iptables_input(probe, family))
            if code:
                why.append(f"{cmd}-restore: {err.splitlines()[0] if err else code}")
                continue
            found[family] = cmd
            break
    if 4 not in found:
        return "; ".join(why) or "no iptables command"
    return ""


async def _ensure_jumps(cmd: str) -> bool:
    """The jumps from the built-in chains to ours, each added once (restore cannot add a rule
    only when it is missing)."""
    for table, parent, chain in JUMPS:
        if (await run([cmd, "-w", "-t", table, "-C", parent, "-j", chain]))[0] == 0:
            continue
        if (await run([cmd, "-w", "-t", table, "-I", parent, "1", "-j", chain]))[0] != 0:
            return False
    return True
