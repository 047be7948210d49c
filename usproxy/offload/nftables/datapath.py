"""NftablesDatapath: the KernelDatapath that offloads ServicePorts into nftables maps.

The layout is described in the package's docstring (usproxy/offload/nftables/__init__.py), its
diffs are Transactions (transaction.py); the transport (libnftables in a worker thread) is
client.py; read back after a restart readback.py. Both families' changes go
into one libnftables call, so one `apply` is one kernel transaction: all or nothing (as kube-proxy
pkg/proxy/nftables/proxier.go syncProxyRules runs one knftables transaction per sync). The
in-memory TableState changes only after the kernel accepted the transaction; after a refused one
the table is read back, so the next diff starts from what the kernel really holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from usproxy.model.types import FAMILIES, Family, IPNetwork
from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import OffloadError
from usproxy.util.gc_pause import LARGE, gc_paused
from usproxy.model.node import LocalAddresses, NodeFacts, read_local_addresses
from usproxy.offload.kernel_conntrack import FrontendKey, KernelConntrack, delete_removed_udp_endpoints, reconcile_logged
from usproxy.offload.kernel_datapath import Capability, TrafficKind
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.core.stale_udp import StaleUdp
from usproxy.offload.nftables.commands import Command, HookSettings, operations, render
from usproxy.offload.nftables.names import TABLE, affinity_endpoint, nft_family
from usproxy.offload.nftables.pins import Pin, parse_pins
from usproxy.offload.nftables.readback import read_table
from usproxy.offload.nftables.rules import ClusterMasq, PortRules, ip_text, port_rules
from usproxy.offload.nftables.transaction import TableState, Transaction
from usproxy.model.service_cidr import union
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

FORMER_MAX = 4096  # removed frontends remembered for /flows (their entries outlive the rules)


class NftTransport(Protocol):
    """What the datapath needs from libnftables (NftClient) or its fake (FakeNftClient)."""

    async def apply(self, commands: Sequence[Command]) -> None: ...

    async def list_table(self, family: str, table: str) -> list[dict[str, Any]] | None: ...

    async def list_set(self, family: str, table: str, name: str) -> str: ...

    def probe(self) -> str: ...

    def close(self) -> None: ...


class NftablesDatapath:
    """Kernel offload through nftables: serves locally originated and forwarded traffic."""

    name = "nftables"
    traffic: frozenset[TrafficKind] = frozenset({"local", "forwarded"})
    write_unit = "nftables operations"

    def __init__(self, transport: NftTransport | None = None, conntrack: KernelConntrack | None = None,
                 *, netns: str | None = None, lb_policy: str = "roundRobin", node: NodeFacts = NodeFacts(),
                 service_cidrs: tuple[IPNetwork, ...] = (), clusterip_interface: str = "usproxy0",
                 addresses: Callable[[], Awaitable[LocalAddresses]] | None = None,
                 node_ips: Callable[[], Collection[IPAddress]] = tuple) -> None:
        """`node` gives the NodePort addresses (NodeFacts.nodeport_ips over the local addresses
        but those of `clusterip_interface`, read by `addresses`, default netlink in `netns`)
        and which endpoints may hairpin; `service_cidrs` the Service CIDRs whose unallocated
        addresses are dropped (commands.cluster_ips_check); `node_ips` this node's addresses now,
        for loadBalancerSourceRanges."""
        if transport is None:
            from usproxy.offload.nftables.client import NftClient

            transport = NftClient(netns)
        self.transport = transport
        self.conntrack = conntrack if conntrack is not None else KernelConntrack(netns)
        self.lb_policy = lb_policy
        self.node = node  # endpoints on other nodes get no hairpin element
        self.flag_cidrs = service_cidrs  # --service-cidr: always checked, with the objects' CIDRs
        self.hooks: dict[Family, HookSettings] = self._hooks(union(service_cidrs))
        self.clusterip_interface = clusterip_interface
        self._addr_worker: NetnsWorker | None = None
        if addresses is None and any(h.nodeport_ips for h in self.hooks.values()):
            worker = self._addr_worker = NetnsWorker("nft-addresses", netns)

            async def addresses() -> LocalAddresses:
                return await worker.run(read_local_addresses, clusterip_interface)
        self._addresses = addresses or _no_addresses
        # this node's addresses now (kube-proxy's nodeIP; the agent gives the relay's): a
        # loadBalancerSourceRanges range holding one allows the LB IPs as sources too
        # (source_ranges.allowed_sources), read once per transaction
        self.node_ips = node_ips
        self.tables: dict[Family, TableState] = {f: self._empty_table(f) for f in FAMILIES}
        self.transactions = 0
        self._operations = 0  # sent in transactions the kernel accepted (kernel_writes)
        # frontends of ServicePorts taken out of the table whose kernel flows may still run on
        # their conntrack entries (a demotion): listed in /flows until none is left
        self._former: dict[FrontendKey, str] = {}
        self._former_lock = threading.Lock()  # flows_view prunes it from a worker thread

    def _hooks(self, cidrs: tuple[IPNetwork, ...]) -> dict[Family, HookSettings]:
        return {f: HookSettings(not self.node.nodeport_match_all(f), tuple(str(n) for n in cidrs if n.version == f))
                for f in FAMILIES}

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        """The ServiceCIDR objects' CIDRs changed (`cidrs`: all of them, service_cidr.union):
        their union with --service-cidr is what each family checks from now on. A family whose
        check changes gets its hooked chains, `cluster-ips-check` included, rewritten by the next
        transaction that changes its table (as kube-proxy rewrites the chain at its next sync), or
        by the next full sync's read back (the Proxier asks for one), which also reaches a family
        holding no ServicePort."""
        hooks = self._hooks(union(self.flag_cidrs, cidrs))
        for f in FAMILIES:
            if hooks[f] != self.hooks[f]:
                log.info("Service CIDRs (IPv%d): %s", f, ", ".join(hooks[f].service_cidrs) or "none")
                self.tables[f].base = False
        self.hooks = hooks

    def _empty_table(self, family: Family) -> TableState:
        return TableState(family, not_local=self._not_local(family), if_local=self._if_local(family))

    def _if_local(self, family: Family) -> str:
        """The detector's "from a pod" match in `family` ("": no detector there)."""
        return self.node.detector.if_local_nft(family) or ""

    def _not_local(self, family: Family) -> str:
        """The detector's "not from a pod" match in `family` ("" without masqueradeAll's
        precedence or a detector for the family: nothing is marked by it)."""
        return "" if self.node.masquerade_all else self.node.detector.if_not_local_nft(family) or ""

    def _cluster_masq(self, family: Family) -> ClusterMasq:
        """What ClusterIP traffic has marked for masquerade, as kube-proxy's nftables mode:
        masqueradeAll marks all of it, else a local-traffic detector marks what is not from a
        pod, else nothing is marked (syncProxyRules, "Set up internal traffic handling")."""
        if self.node.masquerade_all:
            return "all"
        return "nonlocal" if self._not_local(family) else "none"

    # -- KernelDatapath -----------------------------------------------------------------------
    def probe(self) -> Capability:
        """probe_capability(), then conntrack accounting turned on (for byte counts in /flows)."""
        cap = probe_capability(self.transport)
        if not cap.available:
            return cap
        acct = "" if self.conntrack.enable_accounting() else "; no conntrack accounting"
        return Capability(cap.name, True, cap.detail + acct)

    def unsupported(self, state: ServicePortState) -> str | None:
        """What only the relay serves: SCTP (not offloaded). The LB policies it serves are in its
        declaration (nftables/declaration.py), which the offload manager checks: the kernel picks
        with `numgen random`; a ServicePort annotated roundRobin gets `numgen inc` in chains of
        its own (commands.rr_rules); the agent's default roundRobin is served as random, so
        unannotated ServicePorts share chains."""
        if state.service_port.protocol == "SCTP":
            return "SCTP is served by the relay only"
        return None

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """One transaction for both families; OffloadError leaves the kernel unchanged."""
        retimed = await self._retimed_pins(changes)
        with gc_paused(len(changes) > LARGE):
            txs = [self._transaction(self.tables[f], changes) for f in FAMILIES]
            for tx in txs:
                tx.retime(retimed.get(tx.family, {}))
        await self._nodeport_ips(txs)
        with gc_paused(len(changes) > LARGE):
            commands = [c for tx in txs for c in tx.commands()]
        zero_to_n = self._udp_zero_to_n(changes)
        if commands:
            try:
                await self._send(commands)
            except OffloadError:
                await self._resync()
                raise
            self.transactions += 1
        removed = self._frontends(spn for spn, st in changes.items() if st is None)
        for tx in txs:  # also a change with nothing to send: a read back's hairpin count corrected
            tx.fold_into_state()
        if removed:
            with self._former_lock:
                former = {**self._former, **removed}
                self._former = dict(list(former.items())[-FORMER_MAX:])
        if zero_to_n:
            await self.conntrack.delete_udp(orig_dst=zero_to_n)

    async def _nodeport_ips(self, txs: Sequence[Transaction]) -> None:
        """Bring set nodeport-ips up to date in each family that restricts NodePorts, read from
        the addresses interfaces hold now, at every table write (as kube-proxy refills it when
        it rewrites its table); the agent's watch of the addresses makes a change a full sync,
        which writes the table (node.watch_nodeport_addresses)."""
        txs = [tx for tx in txs if tx.based and self.hooks[tx.family].nodeport_ips]
        if not txs:
            return
        ips = self.node.nodeport_ips(await self._addresses(), self.clusterip_interface)
        for tx in txs:
            tx.set_nodeport_ips(frozenset(ip_text(ip) for ip in ips if ip.version == tx.family))

    def _transaction(self, table: TableState, changes: Mapping[ServicePortName, ServicePortState | None]) -> Transaction:
        tx = Transaction(table, self.hooks[table.family])
        if table.rules and not table.base:
            # read back (start, full sync, failed transaction) does not check the hooked chains:
            # rewrite them once, so a rule flushed or changed behind our back (say `ct state
            # invalid drop`) comes back at the next full sync, atomically with this transaction
            tx.ensure_base()
        node_ips = tuple(self.node_ips())
        for spn, st in changes.items():
            prev = table.rules.get(spn)
            new = port_rules(st, table.family, prev, self.node.name, self._cluster_masq(table.family), node_ips) if st is not None else None
            tx.update(prev, new)
        return tx

    async def _retimed_pins(self, changes: Mapping[ServicePortName, ServicePortState | None]
                            ) -> dict[Family, dict[str, tuple[int, list[Pin]]]]:
        """Client pins of ServicePorts whose affinity timeout changes, as the kernel holds them
        now. Set elements keep the timeout they were written with, so the transaction re-adds
        them with the new one, counted from their last connection (field case C15: a new
        timeout is in force at once, for existing pins too)."""
        out: dict[Family, dict[str, tuple[int, list[Pin]]]] = {}
        for f, table in self.tables.items():
            for name, old in _retimed_sets(table, changes).items():
                text = await self.transport.list_set(nft_family(f), TABLE, name)
                out.setdefault(f, {})[name] = (old, parse_pins(text))
        return out

    def _udp_zero_to_n(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> set[tuple[str, int]]:
        """UDP frontends that refused until now and get endpoints in this change (kube-proxy
        clears their conntrack entries so earlier 'refused' flows do not stick)."""
        out = set()
        for spn, st in changes.items():
            if st is None or spn.protocol != "UDP":
                continue
            for table in self.tables.values():
                prev = table.rules.get(spn)
                if prev is None:
                    continue
                for fe in prev.frontends:
                    if fe.addr is not None and not prev.backend(fe.scope).targets and _has_targets(st, fe.scope):
                        out.add((fe.addr, fe.port))
        return out

    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        await self._resync()
        await self._ensure_tracking()
        out: dict[ServicePortName, set[Endpoint]] = {}
        for table in self.tables.values():
            for spn, rules in table.rules.items():
                out.setdefault(spn, set()).update(rules.endpoints())
        return {spn: tuple(sorted(eps)) for spn, eps in out.items()}

    async def _ensure_tracking(self) -> None:
        """Install the table's hooked chains at the first read back, long before anything is
        offloaded. Their rules make the kernel track connections in this namespace from then on,
        so every connection the relay serves has a conntrack entry without NAT from its first
        packet; one that had none would be picked up mid-stream at the first offload, DNATed to
        an endpoint and reset (TCP) or moved to another endpoint (UDP)."""
        for table in self.tables.values():
            if table.base:
                continue
            tx = Transaction(table, self.hooks[table.family])
            tx.ensure_base()
            try:  # per family: a node without IPv6 still tracks IPv4
                await self._send(tx.commands())
            except OffloadError as err:
                log.warning("installing table %s %s: %s", nft_family(table.family), TABLE, err)
                continue
            tx.fold_into_state()

    async def _resync(self) -> None:
        for f in FAMILIES:
            try:
                items = await self.transport.list_table(nft_family(f), TABLE)
            except OffloadError as err:
                log.error("reading back table %s %s: %s", nft_family(f), TABLE, err)
                continue
            self.tables[f] = read_table(f, items)
            self.tables[f].not_local, self.tables[f].if_local = self._not_local(f), self._if_local(f)

    async def reconcile_udp(self, rule: StaleUdp) -> None:
        """Delete the UDP conntrack entries `rule` calls stale, as kube-proxy's CleanStaleEntries."""
        await reconcile_logged(self.conntrack, rule)

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        await delete_removed_udp_endpoints(self.conntrack, removed)

    def frontends(self) -> dict[FrontendKey, str]:
        """(address or "*", PROTO, port) -> ServicePortName text, of what the tables hold."""
        return self._frontends({spn for table in self.tables.values() for spn in table.rules})

    def _frontends(self, spns: Iterable[ServicePortName]) -> dict[FrontendKey, str]:
        out: dict[FrontendKey, str] = {}
        for spn in spns:
            for table in self.tables.values():
                rules = table.rules.get(spn)
                for fe in rules.frontends if rules is not None else ():
                    out[(fe.addr if fe.addr is not None else "*", spn.protocol, fe.port)] = spn.key()
        return out

    def flows_view(self) -> list[FlowRow]:
        """DNATed conntrack entries of the frontends the tables hold, and of frontends taken out
        while their entries live on (a demoted ServicePort's kernel flows run on: README "Live
        flows at the handover"); a former frontend with no entry left is forgotten."""
        current, former = self.frontends(), dict(self._former)
        rows = self.conntrack.flows({**former, **current}, self.name)
        seen = {r["service"] for r in rows}
        gone = {k for k, v in former.items() if k in current or v not in seen}
        with self._former_lock:
            self._former = {k: v for k, v in self._former.items() if k not in gone}
        return rows

    def dump(self) -> str:
        lines = []
        for table in self.tables.values():
            for spn in sorted(table.rules):
                lines += _dump_rules(table.rules[spn])
        return "\n".join(lines)

    async def _send(self, commands: Sequence[Command]) -> None:
        """One transaction to the kernel; its operations counted once it was accepted."""
        await self.transport.apply(commands)
        self._operations += operations(commands)

    def kernel_writes(self) -> int:
        """The operations of every transaction the kernel accepted (KernelWriteCounter)."""
        return self._operations

    async def cleanup(self) -> None:
        """Delete the usproxy tables (both families), whether or not they exist."""
        cmds = []
        for f in FAMILIES:
            cmds += [Command("add", "table", f), Command("delete", "table", f)]
        await self._send(cmds)
        self.tables = {f: self._empty_table(f) for f in FAMILIES}

    def close(self) -> None:
        """Stop the worker threads; the kernel state stays (field case C20)."""
        self.transport.close()
        self.conntrack.close()
        if self._addr_worker is not None:
            self._addr_worker.close()


async def _no_addresses() -> LocalAddresses:
    return []  # every family serves NodePorts on every local address: nothing to read


def probe_capability(transport: NftTransport) -> Capability:
    """Whether nftables can hold this layout: the transport's probe (NftClient.probe loads and
    deletes a table with every feature the layout uses). Never raises: a missing feature is an
    answer (the manager falls back to the relay). The one probe of both the agent and `usproxy
    check`, so they cannot disagree."""
    try:
        backend = transport.probe()
    except Exception as err:
        return Capability("nftables", False, f"nat table with maps and numgen refused: {err}")
    return Capability("nftables", True, f"nat, concatenated maps, numgen ({backend})")


def _retimed_sets(table: TableState, changes: Mapping[ServicePortName, ServicePortState | None]) -> dict[str, int]:
    """Client-address sets of endpoints that stay while their ServicePort's timeout changes,
    with the timeout their rule has had until now."""
    out: dict[str, int] = {}
    for spn, st in changes.items():
        prev = table.rules.get(spn)
        if prev is None or st is None or st.service_port.session_affinity != "ClientIP":
            continue
        timeout = st.service_port.affinity_timeout
        eps = {(ip_text(ep.ip), ep.port) for ep in (*st.cluster_endpoints, *st.external_endpoints)}
        for scope in ("cluster", "external"):
            be = prev.backend(scope)
            if be.affinity and be.affinity != timeout:
                out.update((affinity_endpoint(spn, scope, t.hostport()), be.affinity) for t in be.targets if (t.ip, t.port) in eps)
    return out


def _has_targets(st: ServicePortState, scope: str) -> bool:
    return bool(st.cluster_endpoints if scope == "cluster" else st.external_endpoints)


def _dump_rules(r: PortRules) -> list[str]:
    out = []
    for fe in r.frontends:
        be = r.backend(fe.scope)
        eps = " ".join(t.hostport() for t in be.targets) or ("drop" if be.drop else "reject")
        extra = (" masq-nonlocal" if be.nonlocal_only else " masq" if be.masq else "") + (f" affinity={be.affinity}s" if be.affinity else "")
        if be.short:
            extra += " from pods and node: " + " ".join(t.hostport() for t in be.short)
        out.append(f"{r.spn.key()} {fe.key()} -> {eps}{extra}")
    return out


__all__ = ["NftablesDatapath", "NftTransport", "render"]
