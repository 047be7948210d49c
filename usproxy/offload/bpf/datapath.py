"""BpfDatapath: the KernelDatapath that balances Services at connect(), as Cilium's socket LB.

Programs attached to a cgroup v2 directory (`--bpf-cgroup`) rewrite the destination of connect()
and of unconnected UDP sendmsg() from a ClusterIP to an endpoint, and rewrite it back at recvmsg()
and getpeername() (Cilium bpf/bpf_sock.c: sock4_connect, sock4_sendmsg, sock4_recvmsg,
sock4_getpeername). So it serves only `local` traffic: sockets of processes in that cgroup subtree
(every process on the node for the cgroup v2 root, pods included). Packets arriving from elsewhere
never pass these hooks.

With `nodeport_cidrs` given (`--offload bpf`: the agent passes --nodeport-addresses), the same
object's tc programs (attached with tcx, or where the kernel has no tcx as cls_bpf filters of a
clsact qdisc: the rung is probed, cls_bpf.rung) serve NodePorts, LoadBalancer IPs and externalIPs for IPv4 TCP/UDP packets
arriving at the node's interfaces (nodeport.py chooses them; sock_lb.c's tc section and
tc_frontends.h say how): each ServicePort gets up to two more groups, flagged F_TC_ONLY (the socket
LB never translates them), holding the IPv4 external endpoints (externalTrafficPolicy Local: the
local ones, flagged F_LOCAL_ONLY, never SNATed): NODEPORT_GROUP with NODEPORT_ANY:nodePort and the
externalIPs, LB_GROUP with the LoadBalancer IPs and their loadBalancerSourceRanges. sessionAffinity
ClientIP holds at tc by client address. A group without endpoints refuses through the stack (tc
passes the packet on; the relay does not listen without endpoints, so the kernel refuses, as
kube-proxy REJECTs) or drops (eTP Local with
endpoints only elsewhere, as kube-proxy). The datapath then claims "forwarded" traffic. When the
tc programs cannot be loaded (probe) or attached (open), it serves "local" only, says why in its
capability, and external traffic stays with the relay, whose listeners stay up under the tc hooks
in every case: whatever tc passes (IPv6, refusals, a fragment whose first one tc did not see) is
served there.
With `lb_mode` "dsr" (--bpf-lb-mode) the Cluster-policy tc groups (NodePorts, externalIPs, LB IPs)
are flagged F_DSR: a backend on another node gets the client's packet unSNATed with the service
address in an IP option and answers the client directly (dsr.h; the backend's node finds the
frontend the option names in its own maps, as Cilium does for every external frontend).
Every tc group is selected through a Maglev table over the flow's tuple without the node address
(F_MAGLEV, as Cilium's bpf-lb-algorithm=maglev does for traffic from outside): every node builds the
same table from the same endpoints, so a flow picks the same backend whichever node it enters, and
an endpoint's removal moves only the flows it had. With `acceleration="native"`
(--bpf-lb-acceleration) the XDP program (xdp_lb.h) serves NodePorts first on the hooked interfaces
whose driver has native XDP (xdp.py probes which, from the kernel's xdp-features), tc behind it for
what XDP passes (LB IPs, externalIPs, affinity, DSR, no endpoints, replies) and on the other
interfaces.

Invariants: `apply` writes per changed element and is all-or-nothing (a journal restores every
element on failure); maps, programs and links are pinned, so an agent that exits leaves traffic
flowing and a new one reads the maps back instead of rebuilding them; `cleanup` removes it all.
Maps are sized to the machine at every open (map_sizes.py, from MemTotal and the flags; one entry
for the tc programs' tables when those programs are not loaded); a restart whose sizes differ
from the pins carries the entries into maps of the new sizes (map_resize.py).
A ServicePort without usable endpoints is installed with count 0: connect() and sendmsg() fail
with ECONNREFUSED at once (field case C01).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from usproxy.core.datapath import Placement, ServicePortState
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.config import BpfLbAcceleration, BpfLbMode
from usproxy.model.source_ranges import allowed_sources
from usproxy.model.types import IPNetwork
from usproxy.offload.bpf import cls_bpf, loader, map_sizes, nodeport, view, xdp
from usproxy.offload.bpf.map_sizes import MapSizeFlags, MapSizes
from usproxy.offload.bpf.build import object_path
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.pin_root import default_pin_root
from usproxy.offload.bpf.layout import (
    CT_ORIGINAL,
    F_AFFINITY,
    F_DSR,
    F_DROP_EMPTY,
    F_LB_IPS,
    F_LOCAL_ONLY,
    F_MAGLEV,
    F_ROUND_ROBIN,
    F_SOURCE_RANGES,
    F_TC_ONLY,
    NODEPORT_ANY,
    PROTO_NUMBERS,
    CtEntry,
    FlowVal,
    SvcKey,
)
from usproxy.offload.bpf.tables import Group, IdAllocator, Journal, Tables, Want, address_family
from usproxy.offload.external_route import RELAY
from usproxy.offload.kernel_datapath import ALL_TRAFFIC, Capability, TrafficKind
from usproxy.model.types import ServicePortName, format_hostport
from usproxy.util import cgroup2
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

Selection = Literal["random", "roundRobin", "maglev"]
FLOW_ROWS_MAX = 10000
NODEPORT_GROUP = 0  # the "family" key of a ServicePort's NodePort/externalIP group (4 and 6: ClusterIPs)
LB_GROUP = 1  # the key of its LoadBalancer IP group
EXTERNAL_GROUPS = (NODEPORT_GROUP, LB_GROUP)
LOCAL_ONLY: frozenset[TrafficKind] = frozenset({"local"})


class BpfDatapath:
    """Socket load balancing in cgroup BPF hooks (see the module docstring).

    `selection` is the default for ServicePorts without usproxy.io/lb-policy: "random" (a random
    slot per TCP connect, as Cilium), "roundRobin" (a shared counter per ServicePort) or "maglev"
    (Cilium's Maglev tables: a socket's hash keeps its endpoint when others come and go). UDP
    always hashes the socket cookie, so one socket keeps one endpoint (Cilium's sock_local_cookie).
    """

    name = "bpf"
    write_unit = "BPF map writes"

    def __init__(self, cgroup: Path | None = None, pin_root: Path | None = None,
                 *, selection: str = "random", nodeport_cidrs: tuple[IPNetwork, ...] | None = None,
                 lb_mode: BpfLbMode = "snat", acceleration: BpfLbAcceleration = "disabled",
                 map_sizes: MapSizeFlags = MapSizeFlags(), enable_tcx: bool = True) -> None:
        self.cgroup = cgroup if cgroup is not None else cgroup2.mount_point()
        self.pins = loader.PinLayout(pin_root or default_pin_root())
        self.selection: Selection = _selection(selection)
        self.nodeport_cidrs = nodeport_cidrs  # None: no tc programs
        self.lb_mode: BpfLbMode = lb_mode  # NodePorts at tc: SNAT or DSR to other nodes' backends
        self.traffic: frozenset[TrafficKind] = LOCAL_ONLY
        self.hooked: list[nodeport.HookedInterface] = []  # where the tc programs run (after probe)
        self.tc_detail = "tc NodePort programs not asked for (--offload bpf asks)"
        self.acceleration: BpfLbAcceleration = acceleration  # --bpf-lb-acceleration
        self.map_size_flags = map_sizes  # --bpf-map-dynamic-size-ratio and the per-map flags
        self.enable_tcx = enable_tcx  # --enable-tcx: false takes the clsact rung even where tcx exists
        self.tc_attach: loader.TcAttach = "tcx"  # the rung the tc programs attach on (after probe)
        self.map_sizes: MapSizes | None = None  # as the last open sized them
        self.xdp_plan = xdp.XdpPlan((), ())  # where the XDP program runs (after probe and open)
        self._lb: loader.SockLB | None = None
        self._tables: Tables | None = None
        self._groups: dict[int, Group] = {}  # service id -> group
        self._by_spn: dict[ServicePortName, dict[int, int]] = {}  # spn -> family -> service id
        self.last_writes = 0  # map elements written by the last apply (tests: cost ∝ change)
        self._writes = 0  # by every apply that succeeded (kernel_writes)

    # -- capability -------------------------------------------------------------------------
    def probe(self) -> Capability:
        """BPF syscall, cgroup v2 at `cgroup`, bpffs, and an object to load. Never raises."""
        try:
            detail = self._probe()
        except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
            return Capability("bpf", False, f"{type(err).__name__}: {err}")
        if detail is not None:
            return Capability("bpf", False, detail)
        if self.nodeport_cidrs is not None:
            self._probe_tc()
        return Capability("bpf", True, f"socket LB at connect() for cgroup {self.cgroup}; pins in "
                                       f"{self.pins.base}; {self.external_detail()}")

    def external_detail(self) -> str:
        """Which datapath serves NodePort traffic from outside and why: tc, XDP per interface."""
        if not self.hooked or self.acceleration != "native":
            return self.tc_detail
        names = {h.ifindex: h.name for h in self.hooked}
        return f"{self.tc_detail}; {self.xdp_plan.detail(names)}"

    def _probe_tc(self) -> None:
        """Whether the tc NodePort programs load (the verifier accepts them) and have interfaces
        to run on; sets `traffic`, `hooked` and `tc_detail`. Never raises."""
        try:
            hooked = nodeport.interfaces(self.nodeport_cidrs or ())
            if not hooked:
                raise bpf.BpfError("no interface holds a NodePort address", 0)
            _load_probe(xdp=False)
            self.tc_attach, rung = cls_bpf.rung(self.enable_tcx)
        except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
            self._tc_unavailable(f"{type(err).__name__}: {err}")
            return
        self.hooked, self.traffic = hooked, ALL_TRAFFIC
        self.tc_detail = (f"NodePorts, LoadBalancer IPs and externalIPs at tc ({rung}; lb mode {self.lb_mode}) on "
                          + ", ".join(h.name for h in hooked))
        if self.acceleration == "native":
            self._probe_xdp()

    def _probe_xdp(self) -> None:
        """Where the XDP program can run (xdp.py), once the verifier accepts it. Never raises."""
        try:
            _load_probe(xdp=True)
            self.xdp_plan = xdp.probe(self.hooked)
        except Exception as err:  # noqa: BLE001 - a probe reports, it never raises
            why = f"XDP program unavailable: {type(err).__name__}: {err}"
            self.xdp_plan = xdp.XdpPlan((), tuple((h.name, why) for h in self.hooked))
        log.info("bpf: %s", self.xdp_plan.detail({h.ifindex: h.name for h in self.hooked}))

    def _tc_unavailable(self, why: str) -> None:
        self.hooked, self.traffic = [], LOCAL_ONLY
        self.tc_detail = f"external traffic stays with the relay: tc programs unavailable ({why})"
        log.warning("bpf: %s", self.tc_detail)

    def _probe(self) -> str | None:
        if not self.cgroup.is_dir() or loader.mount_type(self.cgroup) != "cgroup2":
            return f"no cgroup v2 at {self.cgroup} (--bpf-cgroup)"
        try:
            os.close(bpf.map_create(bpf.BPF_MAP_TYPE_ARRAY, "usp_probe", 4, 4, 1))
        except bpf.BpfError as err:
            return f"BPF unavailable: {err}"
        if loader.mount_type(loader.BPFFS) != "bpf" and not loader.BPFFS.is_dir():
            return f"no bpffs at {loader.BPFFS} and nowhere to mount it"
        object_path()  # compiles on first use; raises OffloadError when it cannot
        return None

    def unsupported(self, state: ServicePortState) -> str | None:
        """Why the socket LB cannot serve this ServicePort, or None."""
        sp = state.service_port
        if sp.protocol not in PROTO_NUMBERS:
            return f"{sp.protocol}: the socket LB handles TCP and UDP only"
        if not sp.cluster_ips:
            return "headless Service: no ClusterIP to translate"
        return None  # LB policies: its declaration (bpf/declaration.py), checked by the manager

    # -- KernelDatapath ---------------------------------------------------------------------
    def _open(self) -> Tables:
        if self._tables is None:
            lb = self._open_lb()
            self._lb, self._tables = lb, Tables(lb.maps)
            self._groups = self._tables.read_groups()
            self._drop_orphans(self._tables)
            if self._tables.index_backends(self._groups.values()):
                log.info("bpf: indexed the tc groups' backends in usp_backend_ids (pins of an earlier layout)")
            self._index()
            log.info("bpf socket LB attached to %s (%s, %d service groups)", self.cgroup,
                     "maps read back from pins" if lb.reused else "new maps", len(self._groups))
        return self._tables

    def _open_lb(self) -> loader.SockLB:
        """The socket LB, with the tc programs on `hooked` when probed usable; a tc attach that
        fails leaves the socket LB alone (NodePorts go back to the relay, with the reason)."""
        if self.hooked:
            lb = loader.SockLB(self.pins, self.cgroup, tuple(h.ifindex for h in self.hooked),
                               self.xdp_plan.ifindexes if self.acceleration == "native" else None,
                               sizes=self._sizes(tc=True).entries, tc_attach=self.tc_attach)
            try:
                lb.open()
                nodeport.write_maps(lb.maps, self.hooked, self.nodeport_cidrs or ())
                self._xdp_attached(lb)
                return self._opened(lb)
            except bpf.BpfError as err:
                lb.close()
                self._tc_unavailable(f"attach: {err}")
        lb = loader.SockLB(self.pins, self.cgroup, sizes=self._sizes(tc=False).entries)
        lb.open()
        return self._opened(lb)

    def _sizes(self, *, tc: bool) -> MapSizes:
        """The map sizes for this machine (map_sizes.py), with or without the tc programs."""
        self.map_sizes = map_sizes.plan(self.map_size_flags, map_sizes.total_memory(), tc=tc)
        return self.map_sizes

    def _opened(self, lb: loader.SockLB) -> loader.SockLB:
        if self.map_sizes is not None:
            kept = "; ".join(f"{name} {why}" for name, why in lb.kept.items())
            log.info("bpf maps: %s; the kernel charges %.1f MiB for them%s", self.map_sizes.detail(),
                     lb.memlock() / 2**20, f"; pinned sizes kept: {kept}" if kept else "")
        return lb

    async def node_addresses_changed(self) -> None:
        """The NodePort addresses changed (the agent's poll, node.watch_nodeport_addresses, before
        the full sync it asks for): the interfaces the tc programs run on are read again and
        usp_tc_addrs and usp_tc_ifaces follow their addresses (nodeport.follow). An interface
        that newly holds a NodePort address gets no tc program until a restart (logged); nftables
        or the relay serve its NodePorts meanwhile. Never raises (a failed read is logged and
        the maps stay)."""
        if not self.hooked or self._lb is None or self._lb.tc_ifindexes is None:
            return
        try:
            now = await asyncio.to_thread(nodeport.interfaces, self.nodeport_cidrs or ())
            hooked = nodeport.follow(self.hooked, now)
            nodeport.write_maps(self._lb.maps, hooked, self.nodeport_cidrs or ())
        except Exception as err:  # noqa: BLE001 - the next change or a restart retries
            log.warning("bpf: following the NodePort addresses at tc: %s", err)
            return
        self.hooked = hooked
        log.info("bpf: NodePort addresses at tc now %s", "; ".join(
            f"{h.name} {','.join(map(str, h.addresses)) or 'none'}" for h in hooked))
        for h in nodeport.unhooked(hooked, now):
            log.warning("bpf: %s holds NodePort addresses (%s) but runs no tc program until the agent "
                        "restarts; nftables or the relay serve them", h.name, ", ".join(map(str, h.addresses)))

    def _xdp_attached(self, lb: loader.SockLB) -> None:
        """The plan as the attach left it: an interface that refused the program is tc only."""
        names = {h.ifindex: h.name for h in self.hooked}
        refused = tuple((names[i], f"attach: {why}") for i, why in sorted(lb.xdp_refused.items()))
        self.xdp_plan = xdp.XdpPlan(tuple(lb.xdp_attached), self.xdp_plan.refused + refused)

    def _drop_orphans(self, tables: Tables) -> None:
        """Groups without a frontend or a readable name (an agent that died mid-write) go."""
        orphans = [g for g in self._groups.values() if not g.frontends or ServicePortName.from_key(g.name) is None]
        if not orphans:
            return
        journal = Journal()
        for g in orphans:
            tables.remove_group(journal, g)
            del self._groups[g.id]
        log.warning("bpf: removed %d orphaned service groups found in the pinned maps", len(orphans))

    def _index(self) -> None:
        self._by_spn = {}
        for sid, g in self._groups.items():
            spn = ServicePortName.from_key(g.name)
            if spn is not None and g.frontends:
                self._by_spn.setdefault(spn, {})[_group_key(g)] = sid

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """Install or remove ServicePorts in one transaction. Raises OffloadError."""
        tables = self._open()
        journal = Journal()
        ids = IdAllocator(self._groups, (b for g in self._groups.values() for b in g.backends))
        groups, by_spn = dict(self._groups), {k: dict(v) for k, v in self._by_spn.items()}
        try:
            for spn in sorted(changes):
                self._apply_one(tables, journal, ids, groups, by_spn, spn, changes[spn])
        except Exception:
            journal.rollback()
            raise
        self._groups, self._by_spn = groups, {k: v for k, v in by_spn.items() if v}
        self.last_writes = journal.writes
        self._writes += journal.writes

    def kernel_writes(self) -> int:
        """Map elements written or deleted by every apply that succeeded (KernelWriteCounter)."""
        return self._writes

    def _apply_one(self, tables: Tables, j: Journal, ids: IdAllocator, groups: dict[int, Group],
                   by_spn: dict[ServicePortName, dict[int, int]], spn: ServicePortName,
                   state: ServicePortState | None) -> None:
        wants = self._wants(spn, state) if state is not None else {}
        have = by_spn.setdefault(spn, {})
        for family, sid in sorted(have.items()):
            if family not in wants:
                tables.remove_group(j, groups.pop(sid))
                del have[family]
        for family, want in sorted(wants.items()):
            old = groups.get(have[family]) if family in have else None
            g = tables.sync_group(j, old, want, ids)
            groups[g.id] = g
            have[family] = g.id

    def _wants(self, spn: ServicePortName, state: ServicePortState) -> dict[int, Want]:
        """One Want per IP family of the ServicePort's ClusterIPs. Only ClusterIPs: LoadBalancer IPs
        and externalIPs are never socket LB frontends, so a local connect() to an LB IP reaches
        nftables or the relay, which enforce loadBalancerSourceRanges (nothing bypasses them)."""
        sp = state.service_port
        proto = PROTO_NUMBERS[sp.protocol]
        out: dict[int, Want] = {}
        for ip in sp.cluster_ips:
            family = address_family(ip)
            eps = sorted({ep.address for ep in state.cluster_endpoints if address_family(ep.ip) == family})
            out[family] = Want(spn.key(), frozenset({SvcKey(ip, sp.port, proto)}), tuple(eps),
                               sp.affinity_timeout, self._flags(state))
        if self.traffic == ALL_TRAFFIC:
            out.update(self._external_wants(spn, state, proto))
        return out

    def _external_wants(self, spn: ServicePortName, state: ServicePortState, proto: int) -> dict[int, Want]:
        """The tc programs' groups, IPv4 only, flagged F_TC_ONLY (never socket LB frontends):
        NODEPORT_GROUP holds NODEPORT_ANY:nodePort and the externalIPs, LB_GROUP the LoadBalancer
        ingress IPs with loadBalancerSourceRanges (filtered for LB IPs only, as kube-proxy). Both
        hold the external endpoints (eTP Local: the local ones, F_LOCAL_ONLY, never SNATed)."""
        sp = state.service_port
        eps = tuple(sorted({ep.address for ep in state.external_endpoints if address_family(ep.ip) == 4}))
        # Maglev: the same backend through every node (round robin would differ per node)
        flags = (self._flags(state) & ~F_ROUND_ROBIN) | F_MAGLEV | F_TC_ONLY | self._empty_flags(state, eps)
        dsr = F_DSR if self.lb_mode == "dsr" and not flags & F_LOCAL_ONLY else 0  # as Cilium: every frontend
        out: dict[int, Want] = {}
        ext = {SvcKey(ip, sp.port, proto) for ip in sp.external_ips if address_family(ip) == 4}
        if sp.node_port:
            ext.add(SvcKey(NODEPORT_ANY, sp.node_port, proto))
        if ext:
            out[NODEPORT_GROUP] = Want(spn.key(), frozenset(ext), eps, sp.affinity_timeout, flags | dsr)
        lb_ips = [ip for ip in sp.load_balancer_ips if isinstance(ip, ipaddress.IPv4Address)]
        if lb_ips:
            sources = self._lb_sources(state, lb_ips)
            lb_flags = flags | dsr | F_LB_IPS | (F_SOURCE_RANGES if sources else 0)
            out[LB_GROUP] = Want(spn.key(), frozenset(SvcKey(ip, sp.port, proto) for ip in lb_ips), eps,
                                 sp.affinity_timeout, lb_flags, sources)
        return out

    def external_route(self, state: ServicePortState) -> Placement:
        """How traffic from outside the node reaches `state` here (usproxy.offload.external_route):
        "tc" with what the tc programs do for it, or the relay with the reason."""
        if self.traffic != ALL_TRAFFIC:
            return Placement(RELAY, self.tc_detail)
        sp = state.service_port
        fronts = [*sp.external_ips, *sp.load_balancer_ips]
        if not sp.node_port and not any(address_family(ip) == 4 for ip in fronts):
            return Placement(RELAY, "tc serves IPv4 only; this ServicePort's external frontends are IPv6")
        wants = self._external_wants(ServicePortName("", "", "", sp.protocol), state, PROTO_NUMBERS[sp.protocol])
        flags = next(iter(wants.values())).flags
        notes = [f"tc ({self.tc_attach}) on " + ",".join(h.name for h in self.hooked),
                 "client address kept (externalTrafficPolicy Local)" if flags & F_LOCAL_ONLY
                 else "DSR: an endpoint on another node gets the client's address and answers it directly; "
                 "this node's endpoints are SNATed to the node" if flags & F_DSR
                 else "SNAT to the node when the endpoint is reached through a hooked interface"]
        if not next(iter(wants.values())).endpoints:
            notes.append("no local endpoint: dropped" if flags & F_DROP_EMPTY
                         else "no endpoint: passed to the stack, which refuses (no listener)")
        if LB_GROUP in wants and wants[LB_GROUP].sources:
            notes.append(f"LoadBalancer IPs filtered to {len(wants[LB_GROUP].sources)} source ranges")
        if any(address_family(ip) == 6 for ip in fronts):
            notes.append("IPv6 frontends via the relay")
        return Placement("tc", "; ".join(notes))

    @staticmethod
    def _empty_flags(state: ServicePortState, eps: tuple[tuple[Any, int], ...]) -> int:
        """F_LOCAL_ONLY for eTP Local; F_DROP_EMPTY when that policy leaves no local endpoint while
        the Service has usable ones elsewhere: kube-proxy drops then, and refuses only a Service
        without any usable endpoint (pkg/proxy/nftables/proxier.go, hasEndpoints)."""
        if state.service_port.external_traffic_policy != "Local":
            return 0
        elsewhere = any(address_family(ep.ip) == 4 for ep in usable(state.endpoints))
        return F_LOCAL_ONLY | (F_DROP_EMPTY if not eps and elsewhere else 0)

    def _lb_sources(self, state: ServicePortState, lb_ips: list[ipaddress.IPv4Address]) -> tuple[ipaddress.IPv4Network, ...]:
        """The IPv4 sources allowed to reach `lb_ips` (empty: any), as every datapath computes
        them (usproxy.model.source_ranges.allowed_sources; the hooked addresses stand for the node's)."""
        nodes = [ip for h in self.hooked for ip in h.addresses]
        nets = allowed_sources(state.service_port.source_ranges, 4, lb_ips, nodes)
        return tuple(n for n in nets if isinstance(n, ipaddress.IPv4Network))

    def _flags(self, state: ServicePortState) -> int:
        sp = state.service_port
        flags = F_AFFINITY if sp.session_affinity == "ClientIP" else 0
        policy: str = sp.lb_policy or self.selection  # "maglev" once the annotation allows it
        if policy == "maglev":
            return flags | F_MAGLEV
        return flags | (F_ROUND_ROBIN if policy == "roundRobin" else 0)

    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        """The ServicePorts the pinned maps hold, with the endpoints their slots name."""
        self._open()
        out: dict[ServicePortName, list[Endpoint]] = {}
        for spn, families in self._by_spn.items():
            for key, sid in families.items():
                if key in EXTERNAL_GROUPS:  # the same endpoints, or a subset (eTP Local)
                    out.setdefault(spn, [])
                    continue
                g = self._groups[sid]
                out.setdefault(spn, []).extend(Endpoint(g.backends[b][0], g.backends[b][1]) for b in g.slots)
        return {spn: tuple(sorted(eps)) for spn, eps in out.items()}

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        """Affinity to removed endpoints is purged by `apply`; unconnected UDP sockets pick a new
        endpoint at their next send. Connected UDP sockets keep the address they connected to
        (the socket LB rewrote connect() itself): they are counted and logged here."""
        if self._tables is None or not removed:
            return
        gone = {(ep.ip, ep.port) for eps in removed.values() for ep in eps}
        stuck = [f for f in self._flows() if f.proto == PROTO_NUMBERS["UDP"] and (f.be_ip, f.be_port) in gone]
        if stuck:
            log.warning("bpf: %d UDP sockets still connected to removed endpoints; they recover "
                        "when the application reconnects", len(stuck))

    def _flows(self) -> list[FlowVal]:
        assert self._tables is not None
        items = bpf.map_items(self._tables.fds["usp_flows"], FlowVal.KEY_SIZE, FlowVal.SIZE)
        return [FlowVal.unpack(v) for _, v in items[:FLOW_ROWS_MAX]]

    def flows_view(self) -> list[FlowRow]:
        """Sockets the programs steered and that are still open, then the NodePort flows the tc
        programs NAT, in the /flows row format."""
        if self._tables is None:
            return []
        now = time.monotonic_ns()
        rows = [view.flow_row(f, self._groups, now) for f in self._flows()]
        return rows + [nodeport.ct_row(e, self._service_text(e.svc_id), now) for e in self.ct_entries()
                       if e.direction == CT_ORIGINAL]

    def ct_entries(self) -> list[CtEntry]:
        """The tc programs' connection tracking entries (both directions)."""
        if self._tables is None:
            return []
        return nodeport.ct_entries(self._tables.fds, FLOW_ROWS_MAX)

    def _service_text(self, svc_id: int) -> str:
        g = self._groups.get(svc_id)
        return view.spn_text(g.name) if g else f"<service {svc_id}>"

    def dump(self, *, counters: bool = False) -> str:
        """Stable text of the installed maps; `counters` adds per-endpoint selection counts."""
        if self._tables is None:
            return ""
        selected = {b: v.selected for b, v in self._tables.backends().items()} if counters else {}
        head = f"bpf cgroup={self.cgroup} pins={self.pins.base}"
        if self.hooked:
            head += " tc=" + ",".join(h.name for h in self.hooked) + f" lb-mode={self.lb_mode}"
        if self.xdp_plan.ifindexes:
            names = {h.ifindex: h.name for h in self.hooked}
            head += " xdp=" + ",".join(names.get(i, str(i)) for i in self.xdp_plan.ifindexes)
        return "\n".join([head, *view.group_lines(self._groups, selected)])

    def selected(self, spn: ServicePortName) -> dict[str, int]:
        """How often the programs chose each endpoint of `spn` ("ip:port" -> count)."""
        if self._tables is None:
            return {}
        counts = self._tables.backends()
        out: dict[str, int] = {}
        for sid in self._by_spn.get(spn, {}).values():
            for bid, (ip, port) in self._groups[sid].backends.items():
                out[format_hostport(ip, port)] = counts[bid].selected if bid in counts else 0
        return out

    async def cleanup(self) -> None:
        """Detach every program and remove every pin (`usproxy run --cleanup`)."""
        self.close()
        for what in loader.remove(self.pins):
            log.info("bpf cleanup: removed %s", what)
        self._groups, self._by_spn = {}, {}

    def close(self) -> None:
        """Release this process's fds; pinned programs and maps stay (agent restart, C20)."""
        if self._lb is not None:
            self._lb.close()
        self._lb, self._tables = None, None


def _load_probe(*, xdp: bool) -> None:
    """Load the object once without attaching anything (the verifier's verdict): the tc programs,
    and the XDP program when `xdp`; its maps at one entry each. Raises BpfError."""
    obj = bpf.BpfObject(str(object_path()))
    try:
        loader.shrink_for_probe(obj)
        obj.set_autoload(loader.XDP_PROGRAM, xdp)
        obj.load()
    finally:
        obj.close()


def _group_key(g: Group) -> int:
    """The key of a group under its ServicePort: LB_GROUP, NODEPORT_GROUP or the ClusterIPs' family."""
    if g.val.flags & F_LB_IPS:
        return LB_GROUP
    ip = min(g.frontends).ip
    return NODEPORT_GROUP if ip == NODEPORT_ANY or g.val.flags & F_TC_ONLY else address_family(ip)


def _selection(policy: str) -> Selection:
    """The agent's --lb-policy as a socket-LB selection; leastConnections has no kernel form."""
    if policy in ("random", "roundRobin", "maglev"):
        return policy  # type: ignore[return-value]
    log.warning("bpf: --lb-policy %s is not available in the socket LB; using random", policy)
    return "random"
