"""IpvsDatapath: the KernelDatapath that serves ServicePorts as kube-proxy's IPVS mode.

What it installs is the generator's (rules.py), the very state `usproxy explain --mode ipvs`
prints: per family, IPVS virtual servers with Masq real servers (netlink, kernel.py), the addresses
on kube-ipvs0, kube-proxy's ipsets (`ipset restore`, ipsets.py) and the iptables rules IPVS mode
needs for masquerade, NodePorts and firewalls (`iptables-restore --noflush` with the node's
backend, as the iptables datapath, and its entry jumps). Each sync changes only what differs from
what the kernel holds (the datapath's view of it, read back in full at start and at every full
sync): virtual servers and real servers one by one, set entries in one restore, the iptables
rules when their text changes (they do not grow with the number of Services: the sets do).

Order within a sync, so that nothing points at what is not there yet and a crash leaves no
unnamed state: set entries and usproxy's name for each new virtual server, then kube-ipvs0's new
addresses, the virtual and real servers, the iptables rules; then what goes: real servers,
virtual servers, set entries, addresses.

Live flows (what the kernel does; tests/offload/ipvs run it in the VM lab): IPVS drops every
packet of a connection whose real server was removed, so a real server is not removed while it
holds TCP connections: it goes to weight 0 and is deleted once idle (kube-proxy's graceful
termination); a UDP one goes at once, as kube-proxy's (its next datagram is scheduled again:
expire_nodest_conn). A virtual server that is no longer wanted (its ServicePort demoted, its
Service deleted) but carries connections is *retired*: its real servers go to weight 0 and the
virtual server's own address and port become a real server of it (Masq to a local address is
delivered locally), so new connections reach the socket bound there, the relay's, while the old
ones run on; once they are idle it is deleted. A TCP connection the relay owns when its
ServicePort is offloaded is never rescheduled (IPVS schedules SYNs only); a UDP one is (IPVS
schedules any datagram it has no connection for): it may move to another endpoint at the offload.

Ownership: IPVS services carry no name, so usproxy's own set USPROXY-IPVS (ipsets.py) names each
virtual server it installed with its ServicePortName; any other virtual server is another
program's and is never changed or removed. Reading back adopts what that set names.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import LocalAddresses, NodeFacts, read_local_addresses
from usproxy.model.service_port import LBPolicy
from usproxy.model.service_set import Node
from usproxy.model.types import Family
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.offload.iptables import backend as backends
from usproxy.offload.iptables.backend import Backend, Tools
from usproxy.offload.iptables.client import IptablesClient, IptablesTransport
from usproxy.offload.iptables.family_ports import family_port_of
from usproxy.offload.iptables.restore_input import TableWrite, render
from usproxy.offload.iptables.saved import parse
from usproxy.offload.ipvs import ipsets, rules
from usproxy.offload.ipvs.kernel import Dest, IpvsKernel, Service
from usproxy.offload.ipvs.rules import DUMMY, FILTER_CHAINS, JUMPS, NAT_CHAINS, VsKey
from usproxy.offload.kernel_conntrack import FrontendKey, KernelConntrack, delete_removed_udp_endpoints
from usproxy.offload.kernel_datapath import Capability, TrafficKind
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.util.errors import OffloadError
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

FAMILIES: tuple[Family, ...] = (4, 6)
RECHECK_S = 30.0  # how often terminating real servers and retired virtual servers are looked at
# kube-proxy's NewProxier sysctls (conn_reuse_mode is left as it is from Linux 5.9 on, as kube-proxy)
SYSCTLS = {"net.ipv4.vs.conntrack": "1", "net.ipv4.vs.expire_nodest_conn": "1",
           "net.ipv4.vs.expire_quiescent_template": "1", "net.ipv4.ip_forward": "1"}
PROBE_VS: VsKey = ("TCP", ipaddress.ip_address("198.51.100.0"), 20000)  # kube-proxy's CanUseIPVSProxier


@dataclass
class _Vs:
    """A virtual server of ours as the kernel holds it (the datapath's view)."""

    service: Service
    dests: dict[tuple[IPAddress, int], Dest]
    spn: str  # its ServicePortName text (usproxy's set names it)
    retired: bool = False  # no longer wanted; kept for its connections (module docstring)


@dataclass
class _Family:
    """One family's kernel state as the datapath last wrote or read it."""

    tables: rules.Tables
    sets: dict[str, set[str]] = field(default_factory=dict)  # real set name -> members
    bound: set[IPAddress] = field(default_factory=set)
    iptables: str = ""  # the last restore input written
    jumps_checked: bool = False


@dataclass
class _Plan:
    """What one sync changes in the kernel."""

    device: int | None
    add_vs: list[tuple[Service, list[Dest], str]] = field(default_factory=list)
    edit_vs: list[tuple[Service, str]] = field(default_factory=list)  # also revives a retired one
    put_dest: list[tuple[VsKey, Dest]] = field(default_factory=list)
    drop_dest: list[tuple[VsKey, Dest]] = field(default_factory=list)
    retire: list[VsKey] = field(default_factory=list)
    set_add: dict[Family, dict[str, list[str]]] = field(default_factory=lambda: {4: {}, 6: {}})
    set_del: dict[Family, dict[str, list[str]]] = field(default_factory=lambda: {4: {}, 6: {}})
    bind: list[IPAddress] = field(default_factory=list)
    unbind: list[IPAddress] = field(default_factory=list)


_Wanted = dict[VsKey, tuple[Service, dict[tuple[IPAddress, int], Dest], str]]


@dataclass
class _Scope:
    """What a partial sync of one family may change: the virtual servers, set entries and
    kube-ipvs0 addresses named by the changed ServicePorts' fragments, old and new. The plan
    compares only these with the view, so one change costs what it touches, not the node's
    10,000 Services; a full sync has no scope and compares everything."""

    keys: set[VsKey] = field(default_factory=set)
    entries: set[tuple[str, str]] = field(default_factory=set)  # (set by its IPv4 name, entry)
    bound: set[IPAddress] = field(default_factory=set)

    def take(self, frag: rules.Fragment | None) -> None:
        if frag is not None:
            self.keys.update(vs.key for vs in frag.servers)
            self.entries.update(frag.entries)
            self.bound.update(frag.bound)


class IpvsDatapath:
    """Kernel offload through IPVS: local and forwarded traffic."""

    name = "ipvs"
    traffic: frozenset[TrafficKind] = frozenset({"local", "forwarded"})

    def __init__(self, kernel: IpvsKernel | None = None, tools: IptablesTransport | None = None,
                 conntrack: KernelConntrack | None = None, *, netns: str | None = None, node: NodeFacts = NodeFacts(),
                 lb_policy: LBPolicy = "roundRobin", backend: Backend | None = None,
                 clusterip_interface: str = "usproxy0",
                 addresses: Callable[[], Awaitable[LocalAddresses]] | None = None,
                 node_ips: Callable[[], Collection[IPAddress]] = tuple, load_module: bool = True) -> None:
        """`kernel`: IPVS and kube-ipvs0 (IpvsKernel in `netns`, or a fake); `tools`: the ipset and
        iptables commands and sysctls there; `node`: the node's name, NodePort CIDRs, detector and
        masqueradeAll; `addresses`: the local addresses (NodePort virtual servers on those
        NodeFacts admits, never usproxy0's nor kube-ipvs0's); `node_ips`: this node's addresses
        now (a loadBalancerSourceRanges range holding one lets the node reach the LB IP);
        `load_module`: whether the probe may load ip_vs (its first netlink call does) or needs it
        loaded already."""
        self.kernel = kernel if kernel is not None else IpvsKernel(netns)
        self.tools_client: IptablesTransport = tools if tools is not None else IptablesClient(netns)
        self.conntrack = conntrack if conntrack is not None else KernelConntrack(netns)
        self.node = node
        self.lb_policy = lb_policy
        self.iptables: Tools | None = Tools(backend) if backend is not None else None
        self.clusterip_interface = clusterip_interface
        self.load_module = load_module
        self._addr_worker: NetnsWorker | None = None
        if addresses is None:
            worker = self._addr_worker = NetnsWorker("ipvs-addresses", netns)

            async def addresses() -> LocalAddresses:
                return await worker.run(read_local_addresses, clusterip_interface, DUMMY)
        self._addresses = addresses
        self.node_ips = node_ips
        self.families: tuple[Family, ...] = FAMILIES
        self.installed: dict[ServicePortName, ServicePortState] = {}
        self._held: set[ServicePortName] = set()  # read back, not applied since: IPVS served them already
        self._fam: dict[Family, _Family] = {f: _Family(rules.Tables(f, Node())) for f in FAMILIES}
        self._vs: dict[VsKey, _Vs] = {}
        self._node_addrs: dict[Family, tuple[IPAddress, ...]] = {f: () for f in FAMILIES}
        self._device: int | None = None
        self._probed: Capability | None = None
        self._setup_done = False
        self._need_full = True
        self._random_fully = False
        self._checker: asyncio.Task[None] | None = None
        self.syncs = self.full_syncs = 0

    # -- probing and set-up -----------------------------------------------------------------------
    def probe(self) -> Capability:
        """IPVS answers (a throwaway virtual server added and deleted, as kube-proxy's
        CanUseIPVSProxier), the ipset tool runs and an iptables backend takes the rules' matches
        (in a namespace of its own). Never raises; changes nothing."""
        if self._probed is None:
            try:
                self._probed = Capability(self.name, True, self._check())
            except Exception as err:
                self._probed = Capability(self.name, False, str(err))
        return self._probed

    def _check(self) -> str:
        if not self.load_module and not self.kernel.worker.call(self.kernel.loaded, timeout=30):
            if not self.kernel.installed():
                raise LookupError("no IPVS in this kernel (CONFIG_IP_VS off, no ip_vs module)")
            raise LookupError("ip_vs is not loaded (--offload ipvs loads it, as does modprobe ip_vs)")

        def ipvs() -> None:
            self.kernel.del_service(PROBE_VS)
            self.kernel.add_service(Service(*PROBE_VS, scheduler="rr"))
            self.kernel.del_service(PROBE_VS)
        try:
            self.kernel.worker.call(ipvs, timeout=30)
        except OffloadError as err:
            raise LookupError(f"no IPVS here ({err.message})") from None
        try:
            version = self.kernel.worker.call(self.kernel.ipset, ["--version"], timeout=30)
        except OffloadError as err:
            raise LookupError(f"the ipset tool does not run here, and kube-proxy's IPVS mode needs it ({err})") from None
        if self.iptables is None:
            backend, why = backends.choose(self.tools_client.run_sync, lambda b: self._refusal(Tools(b)))
            self.iptables = Tools(backend)
        else:
            why, fault = "given", self._refusal(self.iptables)
            if fault is not None:
                raise LookupError(f"iptables-{self.iptables.backend}: {fault}")
        if self._refusal(self.iptables, 6) is not None:
            self.families = (4,)
        return (f"IPVS, {version.split(',')[0].strip()}, iptables-{self.iptables.backend} ({why})"
                + ("" if 6 in self.families else "; IPv6 not served"))

    def _refusal(self, tools: Tools, family: Family = 4, random_fully: bool = False) -> str | None:
        """Why `tools` cannot restore the rules' matches (set, socket, addrtype, mark, MASQUERADE),
        tried in a network namespace of its own with a throwaway set."""
        restore = " ".join(tools.restore(family))
        script = f"ipset create KUBE-USPROXY-PROBE hash:ip,port family {'inet' if family == 4 else 'inet6'} && {restore}"
        run = self.tools_client.run_sync
        out = run(["unshare", "--net", "sh", "-c", script], probe_input(family, random_fully))
        return None if out is not None else f"{tools.command(family, 'restore')} refused set, socket or MASQUERADE"

    async def _setup(self) -> None:
        """Once, at the first change: kube-proxy's sysctls, kube-ipvs0, every set."""
        if self._setup_done:
            return
        loop = asyncio.get_running_loop()
        cap = await loop.run_in_executor(None, self.probe)
        if not cap.available:
            raise OffloadError(f"IPVS unavailable: {cap.detail}")
        for path, value in SYSCTLS.items():
            if await self.tools_client.sysctl(path, value) != value:
                log.warning("cannot set %s=%s", path, value)
        assert self.iptables is not None
        self._random_fully = await loop.run_in_executor(None, self._refusal, self.iptables, 4, True) is None
        self._device = await self.kernel.run(self.kernel.ensure_device)
        text = "".join(line + "\n" for f in self.families for line in ipsets.create_lines(f))
        await self.kernel.run(self.kernel.ipset, ["-exist", "restore"], text)
        self._setup_done = True

    # -- KernelDatapath ---------------------------------------------------------------------------
    def unsupported(self, state: ServicePortState) -> str | None:
        sp = state.service_port
        if sp.protocol == "SCTP":
            return "SCTP is served by the relay only"
        if not any(ip.version in self.families for ip in sp.cluster_ips):
            return "no ClusterIP of a family this host's IPVS datapath serves"
        return None

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """One pass over the kernel; OffloadError when a step is refused (the view is then read
        again, and the next pass repairs what this one left half done)."""
        await self._setup()
        installed = dict(self.installed)
        for spn, st in changes.items():
            if st is None:
                installed.pop(spn, None)
            else:
                installed[spn] = st
        full = self._need_full
        self._need_full = True
        zero_to_n, turned = self._udp_newly_active(changes)
        try:
            plan = await self._sync(installed, set(changes), full, zero_to_n)
        except OffloadError:
            await self._read_view()
            raise
        self._need_full = False
        self.installed = installed
        self._held -= set(changes)
        if turned:
            await self.conntrack.delete_udp_turned_answers(turned)
        self._start_checker(self._vs.keys() if full else {key for key, _ in plan.drop_dest} | set(plan.retire))

    async def _sync(self, installed: Mapping[ServicePortName, ServicePortState], changed: set[ServicePortName],
                    full: bool, zero_to_n: set[tuple[str, int]]) -> _Plan:
        scopes: dict[Family, _Scope | None] = {}
        tables = {}
        for f in self.families:
            tables[f], scopes[f] = await self._tables(f, installed, changed, full)
        plan = self._plan(tables, scopes)
        await self._add_deleting_udp(plan, zero_to_n)
        await self._write_iptables(tables, full)
        await self.kernel.run(self._execute_remove, plan)
        for f, t in tables.items():
            self._fam[f].tables = t
        self.syncs += 1
        self.full_syncs += full
        return plan

    async def _add_deleting_udp(self, p: _Plan, zero_to_n: set[tuple[str, int]]) -> None:
        """The plan's additions, and the conntrack entries to `zero_to_n` deleted as soon as the
        virtual servers are in: until an entry is gone, a datagram IPVS forwards on it gets an
        answer the kernel drops (the entry, made by the relay's session, has no NAT; test_kernel).
        The entries are listed before the write, so the delete after it opens and dumps nothing;
        then one more pass takes those made between the listing and the write."""
        listed = await self.conntrack.list_udp(zero_to_n) if zero_to_n else None
        try:
            await self.kernel.run(self._execute_add, p)
        finally:
            if listed is not None:
                await self.conntrack.delete_listed(listed)
        if zero_to_n:
            await self.conntrack.delete_udp(orig_dst=zero_to_n)

    async def _tables(self, family: Family, installed: Mapping[ServicePortName, ServicePortState],
                      changed: set[ServicePortName], full: bool) -> tuple[rules.Tables, _Scope | None]:
        """The generator's state after this change: fragments of the changed ServicePorts only,
        with the scope they touch, unless what every fragment depends on changed (the node's
        addresses, its facts): then every fragment anew, and no scope."""
        node = self._node(family)
        addrs = await self._node_addresses(family)
        old = self._fam[family].tables
        redo = full or addrs != self._node_addrs[family] or node != old.node
        self._node_addrs[family] = addrs
        t = rules.Tables(family, node) if redo else _copy(old)
        scope = None if redo else _Scope()
        for spn in (installed if redo else changed):
            st = installed.get(spn)
            fp = family_port_of(st, family) if st is not None else None
            frag = rules.fragment(fp, node, addrs, self.lb_policy) if fp is not None else None
            if scope is not None:
                scope.take(t.fragments.get(spn))
                scope.take(frag)
            t.put(frag, spn)
        return t, scope

    def _node(self, family: Family) -> Node:
        return Node(self.node.name, tuple(ip for ip in self.node_ips() if ip.version == family),
                    detector=self.node.detector, masquerade_all=self.node.masquerade_all)

    async def _node_addresses(self, family: Family) -> tuple[IPAddress, ...]:
        """The node's own addresses where NodePorts are served (kube-proxy: every local address
        but kube-ipvs0's and loopback, or those --nodeport-addresses admits)."""
        local = [(i, a) for i, a in await self._addresses() if i != DUMMY and a.version == family]
        return self.node.nodeport_ips(local, self.clusterip_interface)

    # -- the plan ---------------------------------------------------------------------------------
    def _plan(self, tables: Mapping[Family, rules.Tables], scopes: Mapping[Family, _Scope | None]) -> _Plan:
        """What to change to go from the view to `tables`, within each family's scope (all of
        it when it has none); the view's sets and addresses become the plan's (virtual servers
        change in the view as their steps run)."""
        p = _Plan(device=self._device)
        names: dict[Family, set[str]] = {4: set(), 6: set()}
        for f, t in tables.items():
            wanted = self._wanted(t, scopes[f])
            self._plan_servers(p, wanted, names[f])
            scope = scopes[f]
            candidates = self._vs.keys() if scope is None else scope.keys
            p.retire += [key for key in candidates if _family(key) == f and key in self._vs
                         and key not in wanted and not self._vs[key].retired]
            self._plan_sets(p, f, t, scope)
            p.set_add[f][ipsets.NAMES_SET] = sorted(names[f])
        return p

    def _wanted(self, t: rules.Tables, scope: _Scope | None) -> _Wanted:
        """The virtual servers `t` holds (those of `scope` only, when there is one) as the kernel
        should: by key, the service, its real servers and its ServicePortName's text."""
        servers = t.servers() if scope is None else {k: vs for k in scope.keys if (vs := t.server(k)) is not None}
        return {key: (Service(vs.proto, vs.address, vs.port, vs.scheduler, rules.PERSISTENT if vs.persistent else 0,
                              vs.persistent or 0), {(e.ip, e.port): Dest(e.ip, e.port) for e in vs.reals}, vs.spn.key())
                for key, vs in servers.items()}

    def _plan_servers(self, p: _Plan, wanted: _Wanted, names: set[str]) -> None:
        """Virtual servers to add or edit and real servers to put or drop; `names` gets the
        USPROXY-IPVS entries of those not yet named as they are now."""
        for key, (svc, dests, spn) in wanted.items():
            have = self._vs.get(key)
            if have is None or have.spn != spn:
                names.add(ipsets.named_entry(_vs_entry(key), spn))
            if have is None:
                p.add_vs.append((svc, list(dests.values()), spn))
                continue
            if have.service != svc or have.retired or have.spn != spn:
                p.edit_vs.append((svc, spn))
            p.put_dest += [(key, d) for dk, d in dests.items() if not _same(have.dests.get(dk), d)]
            p.drop_dest += [(key, old) for dk, old in have.dests.items() if dk not in dests]

    def _plan_sets(self, p: _Plan, f: Family, t: rules.Tables, scope: _Scope | None) -> None:
        """The ipset entries and kube-ipvs0 addresses to add and remove: every one compared on a
        full sync, the scope's only on a partial one."""
        fam = self._fam[f]
        if scope is None:
            want = {s.named(f): set(t.entries[s.name]) for s in rules.SETS}
            for name, members in want.items():
                have_m = fam.sets.get(name, set())
                p.set_add[f][name] = sorted(members - have_m)
                p.set_del[f][name] = sorted(have_m - members)
            bound = set(t.bound)
            p.bind += sorted(bound - fam.bound, key=lambda ip: ip.packed)
            p.unbind += sorted(fam.bound - bound, key=lambda ip: ip.packed)
            fam.sets, fam.bound = want, bound
            return
        for name, entry in sorted(scope.entries):
            real, present = rules.SET_BY_NAME[name].named(f), entry in t.entries[name]
            members = fam.sets.setdefault(real, set())
            if present != (entry in members):
                (p.set_add if present else p.set_del)[f].setdefault(real, []).append(entry)
                (members.add if present else members.discard)(entry)
        for ip in sorted(scope.bound, key=lambda ip: ip.packed):
            present = ip in t.bound
            if present != (ip in fam.bound):
                (p.bind if present else p.unbind).append(ip)
                (fam.bound.add if present else fam.bound.discard)(ip)

    # -- run in the kernel's worker thread --------------------------------------------------------
    def _execute_add(self, p: _Plan) -> None:
        self._ipset_restore("add", p.set_add)
        if p.bind and p.device is not None:
            self.kernel.bind(p.device, p.bind)
        self._add_all(p.add_vs)
        for svc, spn in p.edit_vs:
            self.kernel.edit_service(svc)
            vs = self._vs[svc.key]
            vs.service, vs.spn, vs.retired = svc, spn, False
        for key, d in p.put_dest:
            self._put_dest(key, d)

    def _add_all(self, adds: list[tuple[Service, list[Dest], str]]) -> None:
        """New virtual servers with their real servers, many to a netlink write (kernel.py); one
        whose key exists and is not ours yet (a kube-proxy leftover) is taken over as it is named
        now. Every outcome is recorded before the first refusal is raised."""
        if not adds:
            return
        failure: OffloadError | None = None
        for (svc, dests, spn), (code, codes) in zip(adds, self.kernel.add_services([(s, d) for s, d, _ in adds])):
            if code == errno.EEXIST:
                self._take_over(svc, spn, dests)
                continue
            if code:
                failure = failure or OffloadError(f"IPVS add service {svc.key}: {os.strerror(code)}", errno=code)
                continue
            self._vs[svc.key] = _Vs(svc, {d.key: d for d, c in zip(dests, codes) if c == 0}, spn)
            refused = next(((d, c) for d, c in zip(dests, codes) if c), None)
            if refused is not None and failure is None:
                d, c = refused
                failure = OffloadError(f"IPVS add real server {d.key} to {svc.key}: {os.strerror(c)}", errno=c)
        if failure is not None:
            raise failure

    def _take_over(self, svc: Service, spn: str, dests: list[Dest]) -> None:
        self.kernel.edit_service(svc)
        self._vs[svc.key] = _Vs(svc, {d.key: d for d in self.kernel.dests(svc.key)}, spn)
        for d in dests:
            self._put_dest(svc.key, d)

    def _put_dest(self, key: VsKey, d: Dest) -> None:
        vs = self._vs[key]
        if vs.dests.get(d.key) == d:
            return
        if d.key in vs.dests:
            self.kernel.edit_dest(key, d)
        else:
            self.kernel.add_dest(key, d)
        vs.dests[d.key] = d

    def _execute_remove(self, p: _Plan) -> None:
        for key, d in p.drop_dest:
            self._drop_dest(key, d)
        for key in p.retire:
            self._retire(key)
        self._ipset_restore("del", p.set_del)
        if p.unbind and p.device is not None:
            self.kernel.unbind(p.device, p.unbind)

    def _drop_dest(self, key: VsKey, d: Dest) -> None:
        """kube-proxy's graceful termination: a TCP real server with connections goes to weight
        0 until they end; a UDP one and an idle one go now."""
        vs = self._vs[key]
        live = next((x for x in self.kernel.dests(key) if x.key == d.key), None)
        if live is not None and key[0] != "UDP" and live.connections:
            quiet = replace(d, weight=0)
            if live.weight:
                self.kernel.edit_dest(key, quiet)
            vs.dests[d.key] = quiet
            return
        self.kernel.del_dest(key, d)
        vs.dests.pop(d.key, None)

    def _retire(self, key: VsKey) -> None:
        """An unwanted virtual server: deleted when idle, else retired (module docstring)."""
        vs = self._vs[key]
        live = self.kernel.dests(key)
        local = (key[1], key[2])
        busy = [d for d in live if d.key != local and d.connections]
        if not busy:
            self._delete_vs(key)
            return
        for d in live:
            if d.key != local and not d.connections:
                self.kernel.del_dest(key, d)
            elif d.key != local and d.weight:
                self.kernel.edit_dest(key, replace(d, weight=0))
        here = Dest(key[1], key[2])
        if local not in {d.key for d in live}:
            self.kernel.add_dest(key, here)
        vs.retired = True
        vs.dests = {**{d.key: replace(d, weight=0) for d in busy}, local: here}

    def _delete_vs(self, key: VsKey) -> None:
        self.kernel.del_service(key)
        del self._vs[key]
        self._ipset_restore("del", {_family(key): {ipsets.NAMES_SET: [_vs_entry(key)]}})

    def _ipset_restore(self, verb: str, entries: Mapping[Family, Mapping[str, list[str]]]) -> None:
        text = "".join(line + "\n" for f, sets in entries.items()
                       for line in ipsets.entry_lines(verb, f, {n: m for n, m in sets.items() if m}))
        if text:
            self.kernel.ipset(["-exist", "restore"], text)

    # -- iptables ---------------------------------------------------------------------------------
    async def _write_iptables(self, tables: Mapping[Family, rules.Tables], full: bool) -> None:
        """Each family's rules when their text changed (always on a full sync), with the entry
        jumps inserted where missing (checked on full syncs)."""
        assert self.iptables is not None
        for f, t in tables.items():
            fam = self._fam[f]
            text = t.restore_input(self._random_fully)
            if text == fam.iptables and not full:
                continue
            writes = {"nat": TableWrite("nat", list(NAT_CHAINS)), "filter": TableWrite("filter", list(FILTER_CHAINS))}
            table = ""
            for line in text.splitlines():
                if line.startswith("*"):
                    table = line[1:]
                elif line.startswith("-A "):
                    writes[table].rules.append(line)
            if full or not fam.jumps_checked:
                saved = parse(await self.tools_client.run(self.iptables.save(f)))
                for name, w in writes.items():
                    have = {r.text() for r in saved[name].rules} if name in saved else set()
                    w.edits = [j.text().replace(f"-A {j.base} ", f"-I {j.base} 1 ", 1)
                               for j in JUMPS if j.table == name and j.text() not in have]
            await self.tools_client.run(self.iptables.restore(f), render(list(writes.values())))
            fam.iptables, fam.jumps_checked = text, True

    # -- read back, conntrack, views --------------------------------------------------------------
    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        """The ServicePorts whose virtual servers usproxy's set names, with their real servers
        (retired ones left out: they are not wanted). Creates nothing: an agent that never offloads
        to IPVS leaves the node without kube-ipvs0 and sets."""
        cap = await asyncio.get_running_loop().run_in_executor(None, self.probe)
        if not cap.available:
            raise OffloadError(f"IPVS unavailable: {cap.detail}")
        await self._read_view()
        self._need_full = True
        out: dict[ServicePortName, set[Endpoint]] = {}
        for vs in self._vs.values():
            if vs.retired:
                continue
            spn = ServicePortName.from_key(vs.spn)
            if spn is None:
                continue
            out.setdefault(spn, set()).update(Endpoint(ip, port) for (ip, port), d in vs.dests.items() if d.weight)
        self._held = set(out)
        return {spn: tuple(sorted(eps, key=str)) for spn, eps in out.items()}

    async def _read_view(self) -> None:
        """The view from the kernel: the virtual servers usproxy's set names, the sets' members
        and kube-ipvs0's addresses."""
        saved = ipsets.parse_save(await self.kernel.run(self.kernel.ipset, ["save"]))
        dumped = await self.kernel.run(self.kernel.dump)
        bound = await self.kernel.run(self.kernel.device_addresses) or set()
        self._vs = {}
        for f in FAMILIES:
            names = ipsets.names(saved, f)
            fam = self._fam[f]
            fam.sets = {s.named(f): set(saved[s.named(f)].members) if s.named(f) in saved else set()
                        for s in rules.SETS}
            fam.bound = {ip for ip in bound if ip.version == f}
            fam.iptables, fam.jumps_checked = "", False
            for svc, dests in dumped:
                spn = names.get(_vs_entry(svc.key))
                if svc.address.version != f or spn is None:
                    continue
                retired = (svc.address, svc.port) in {d.key for d in dests}
                self._vs[svc.key] = _Vs(svc, {d.key: d for d in dests}, spn, retired)

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        """UDP conntrack entries of removed endpoints, as kube-proxy's CleanStaleEntries."""
        await delete_removed_udp_endpoints(self.conntrack, removed)

    def _udp_newly_active(self, changes: Mapping[ServicePortName, ServicePortState | None]
                          ) -> tuple[set[tuple[str, int]], set[tuple[tuple[str, int], str]]]:
        """(UDP frontends, (endpoint, Service address) pairs) whose conntrack entries go after
        this change. Frontends that refused until now, or that this datapath did not serve (the
        relay did, or the Service is new; not one read back), and get endpoints: kube-proxy's
        CleanStaleEntries for newly active UDP Services, which here also removes a relayed
        session's entry. Made without NAT, it would clash with IPVS's answers to that session's
        next datagrams: the kernel gives those another source port, which the client's connected
        socket drops (seen in the VM lab; docs/platform.md, IPVS). The pairs, for a ServicePort
        new to this datapath: the entries such a clash made before the frontend's went."""
        out: set[tuple[str, int]] = set()
        turned: set[tuple[tuple[str, int], str]] = set()
        for spn, st in changes.items():
            prev = self.installed.get(spn)
            if st is None or spn.protocol != "UDP" or (prev is None and spn in self._held):
                continue
            sp = st.service_port
            for eps, before, ips in ((st.cluster_endpoints, prev.cluster_endpoints if prev else (), sp.cluster_ips),
                                     (st.external_endpoints, prev.external_endpoints if prev else (),
                                      (*sp.external_ips, *sp.load_balancer_ips))):
                if before or not eps:
                    continue
                out |= {(str(ip), sp.port) for ip in ips}
                if prev is None:
                    turned |= {((str(e.ip), e.port), str(ip)) for e in eps for ip in ips if e.ip.version == ip.version}
        return out, turned

    def frontends(self) -> dict[FrontendKey, str]:
        """(address, PROTO, port) -> ServicePortName text of every virtual server of ours."""
        return {(str(addr), proto, port): vs.spn for (proto, addr, port), vs in self._vs.items()}

    def flows_view(self) -> list[FlowRow]:
        """Kernel conntrack entries to the virtual servers (IPVS keeps them with vs.conntrack=1)."""
        return self.conntrack.flows(self.frontends(), self.name)

    def dump(self) -> str:
        out = []
        for f in FAMILIES:
            t = self._fam[f].tables
            if t.fragments:
                vss = sorted(t.servers().values(), key=rules.VirtualServer.sort_key)
                out.append(f"# IPv{f}\n" + "\n".join(f"{vs.proto} {vs.address} {vs.port} {vs.scheduler} "
                                                    f"{' '.join(map(str, vs.reals))}" for vs in vss))
        return "\n".join(out)

    def tables(self, family: Family) -> rules.Tables:
        """The generator's state the kernel holds for `family` (after the last sync)."""
        return self._fam[family].tables

    # -- the periodic check -----------------------------------------------------------------------
    def _start_checker(self, touched: Collection[VsKey]) -> None:
        """The periodic check, if a real server is left draining or a virtual server retired
        among `touched` (a partial sync's drops and retirements, or every virtual server after a
        full one, which may have adopted draining ones); it runs until none is left."""
        if self._checker is not None and not self._checker.done():
            return
        vss = [self._vs[key] for key in touched if key in self._vs]
        if any(vs.retired or any(d.weight == 0 for d in vs.dests.values()) for vs in vss):
            self._checker = asyncio.get_running_loop().create_task(self._check_loop())

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            try:
                if not await self.kernel.run(self.collect):
                    return
            except OffloadError as err:
                log.warning("IPVS: checking terminating real servers: %s", err)

    def collect(self) -> bool:
        """Delete the terminating real servers and retired virtual servers that are idle now
        (in the kernel's worker thread); True while some remain."""
        left = False
        for key, vs in list(self._vs.items()):
            if not vs.retired and all(d.weight for d in vs.dests.values()):
                continue
            live = {d.key: d for d in self.kernel.dests(key)}
            local = (key[1], key[2])
            if vs.retired:
                if any(d.connections for k, d in live.items() if k != local):
                    left = True
                else:
                    self._delete_vs(key)
                continue
            for dk, d in list(vs.dests.items()):
                now = live.get(dk)
                if d.weight == 0 and (now is None or not now.connections):
                    self.kernel.del_dest(key, d)
                    del vs.dests[dk]
                elif d.weight == 0:
                    left = True
        return left

    # -- cleanup ----------------------------------------------------------------------------------
    async def cleanup(self, keep_busy: bool = False) -> None:
        """Remove every virtual server usproxy's set names, kube-ipvs0, this mode's chains and
        jumps and the sets (leftovers.py); with `keep_busy` (leftovers at an agent's start) the
        virtual servers carrying connections stay. Another program's virtual servers stay."""
        from usproxy.offload.ipvs import leftovers

        if self._checker is not None:
            self._checker.cancel()
        kept = await leftovers.remove(self.kernel, self.tools_client, keep_busy)
        if kept:
            log.info("kept %d IPVS virtual servers of an earlier run until their connections end", len(kept))
        self._vs, self.installed, self._held = {}, {}, set()
        self._fam = {f: _Family(rules.Tables(f, Node())) for f in FAMILIES}
        self._setup_done, self._need_full = False, True

    async def leftovers(self, keep_busy: bool = False) -> list[str]:
        """What this mode holds in this namespace (leftovers.describe), changing nothing; with
        `keep_busy`, what cleanup(keep_busy=True) would remove."""
        from usproxy.offload.ipvs import leftovers

        return await leftovers.describe(self.kernel, self.tools_client, keep_busy)

    def close(self) -> None:
        """Stop the threads; what is installed stays (C20)."""
        if self._checker is not None:
            self._checker.cancel()
        self.kernel.close()
        self.tools_client.close()
        self.conntrack.close()
        if self._addr_worker is not None:
            self._addr_worker.close()


def _same(a: Dest | None, b: Dest) -> bool:
    """Whether real server `a` is configured as `b` (connection counts aside)."""
    return a is not None and a.weight == b.weight and a.fwd == b.fwd


def _family(key: VsKey) -> Family:
    return 4 if key[1].version == 4 else 6


def _vs_entry(key: VsKey) -> str:
    """A virtual server as an entry of usproxy's set: "ip,proto:port"."""
    proto, addr, port = key
    return f"{addr},{proto.lower()}:{port}"


def _copy(t: rules.Tables) -> rules.Tables:
    return rules.Tables(t.family, t.node, dict(t.fragments), {k: Counter(v) for k, v in t.entries.items()},
                        Counter(t.bound), Counter(t.no_node_access), dict(t.claims))


def probe_input(family: Family, random_fully: bool = False) -> str:
    """A throwaway chain with every match the rules use (the set KUBE-USPROXY-PROBE exists where
    it runs), created and deleted in one restore."""
    c, lo = "KUBE-USPROXY-PROBE", "127.0.0.0/8" if family == 4 else "::1/128"
    nat = [f"-A {c} -s {lo} -m set --match-set {c} dst,dst -j RETURN",
           f"-A {c} -m addrtype --dst-type LOCAL -m mark ! --mark 0x004000/0x004000 -j RETURN",
           f"-A {c} -j MASQUERADE" + (" --random-fully" if random_fully else "")]
    filt = [f"-A {c} -m socket --nowildcard -j RETURN",
            f"-A {c} -m conntrack --ctstate NEW -m comment --comment probe -j REJECT"]
    lines = []
    for table, rs in (("nat", nat), ("filter", filt)):
        lines += [f"*{table}", f":{c} - [0:0]", *rs, f"-F {c}", f"-X {c}", "COMMIT"]
    return "\n".join(lines) + "\n"
