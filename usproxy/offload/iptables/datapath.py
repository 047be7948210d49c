"""IptablesDatapath: the KernelDatapath that serves ServicePorts with kube-proxy's iptables rules.

The rules are the generator's (rules.py), the very text `usproxy explain --mode iptables` prints:
per family, a skeleton and one fragment per ServicePort, regenerated only for the ServicePorts a
sync changes (or all of them when what every fragment depends on changes: the node's addresses,
or crossing into large-cluster mode). Each sync is one `iptables-restore --noflush` per family,
as kube-proxy's syncProxyRules (pkg/proxy/iptables/proxier.go):

- a partial sync writes the filter table's chains, the nat table's top-level chains
  (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-POSTROUTING, KUBE-MARK-MASQ) and the chains of the changed
  ServicePorts, and deletes the per-ServicePort chains no longer wanted;
- a full sync (after every read back, i.e. at start and at the Proxier's periodic full syncs, and
  when a partial one is refused) first reads iptables-save, writes every chain, deletes every
  stale per-ServicePort chain it finds, inserts the entry jumps that are missing at the top of
  the built-in chains, and keeps the KUBE-PROXY-CANARY chains in mangle, nat and filter.

Nothing of another program is named in the input, so Docker's, a firewall's or kubelet's rules
stay as they are; cleanup (leftovers.py) deletes only what this mode writes. The backend is the
one the node uses (backend.py); `probe` checks that it takes every match and target the rules
use, in a throwaway chain created and deleted in one restore. A refused restore leaves its table
unchanged; the in-memory view changes only once every family's restore succeeded, and any
failure makes the next sync a full one (an IPv4 table already written is then re-read). The
first read back writes the skeleton when the kernel holds none, long before anything is
offloaded: from then on the kernel tracks every connection in the namespace, so the relay's flows
have conntrack entries without NAT from their first packet and keep draining in the relay when
their ServicePort is offloaded (as the nftables datapath's first read back does).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from usproxy.core.datapath import ServicePortState
from usproxy.core.stale_udp import StaleUdp
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import LocalAddresses, NodeFacts, read_local_addresses
from usproxy.model.service_set import Node
from usproxy.model.types import Family
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.offload.iptables import backend as backends
from usproxy.offload.iptables import names
from usproxy.offload.iptables.backend import Backend, Tools
from usproxy.offload.iptables.client import IptablesClient, IptablesTransport
from usproxy.offload.iptables import family_rules
from usproxy.offload.iptables.family_rules import FamilyRules
from usproxy.offload.iptables.jumps import DATAPATH_JUMPS
from usproxy.offload.iptables.leftovers import describe, removal
from usproxy.offload.iptables.readback import ReadBack, read
from usproxy.offload.iptables.restore_input import TableWrite, render
from usproxy.offload.iptables.rules import Options, Ruleset, render_ruleset
from usproxy.offload.iptables.saved import parse
from usproxy.offload.kernel_conntrack import FrontendKey, KernelConntrack, delete_removed_udp_endpoints, reconcile_logged
from usproxy.offload.kernel_datapath import Capability, TrafficKind
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.util.errors import OffloadError
from usproxy.util.gc_pause import LARGE, gc_paused
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

FAMILIES: tuple[Family, ...] = (4, 6)
FORMER_MAX = 4096  # removed frontends remembered for /flows (their entries outlive the rules)
PROBE_CHAIN = "KUBE-USPROXY-PROBE"
LIBERAL = "net.netfilter.nf_conntrack_tcp_be_liberal"
ROUTE_LOCALNET = "net.ipv4.conf.all.route_localnet"


@dataclass
class _Write:
    """One family's restore input and the state it leaves when it succeeds."""

    family: Family
    texts: list[str]  # restore inputs, run in order
    after: FamilyRules
    kernel_chains: set[str]


class IptablesDatapath:
    """Kernel offload through kube-proxy's iptables rules: local and forwarded traffic."""

    name = "iptables"
    traffic: frozenset[TrafficKind] = frozenset({"local", "forwarded"})
    write_unit = "iptables-restore lines"

    def __init__(self, client: IptablesTransport | None = None, conntrack: KernelConntrack | None = None, *,
                 netns: str | None = None, node: NodeFacts = NodeFacts(), lb_policy: str = "roundRobin",
                 backend: Backend | None = None, localhost_nodeports: bool = True,
                 clusterip_interface: str = "usproxy0",
                 addresses: Callable[[], Awaitable[LocalAddresses]] | None = None,
                 node_ips: Callable[[], Collection[IPAddress]] = tuple, hairpin_mark: int = 0) -> None:
        """`backend` None: the node's (backend.choose). `node` gives the node name, the NodePort
        addresses (NodeFacts.nodeport_ips over the local addresses, read by `addresses`, default
        netlink in `netns`, but those of `clusterip_interface`), the local-traffic detector and
        masqueradeAll; `node_ips` this node's addresses now (a loadBalancerSourceRanges range
        holding one allows the LB IPs as sources, kube-proxy's allowFromNode).
        `localhost_nodeports`: kube-proxy's --iptables-localhost-nodeports (only where every IPv4
        address serves NodePorts, as kube-proxy; it sets route_localnet). `hairpin_mark`:
        --hairpin-mark (Options.hairpin_mark)."""
        self.client: IptablesTransport = client if client is not None else IptablesClient(netns)
        self.conntrack = conntrack if conntrack is not None else KernelConntrack(netns)
        self.node = node
        self.lb_policy = lb_policy
        self.tools: Tools | None = Tools(backend) if backend is not None else None
        self.backend_reason = "given" if backend is not None else ""
        self.families: tuple[Family, ...] = FAMILIES
        self.localhost_nodeports = localhost_nodeports and node.nodeport_match_all(4)
        self.hairpin_mark = hairpin_mark
        self.clusterip_interface = clusterip_interface
        self._addr_worker: NetnsWorker | None = None
        if addresses is None and not all(node.nodeport_match_all(f) for f in FAMILIES):
            worker = self._addr_worker = NetnsWorker("ipt-addresses", netns)

            async def addresses() -> LocalAddresses:
                return await worker.run(read_local_addresses, clusterip_interface)
        self._addresses = addresses
        self.node_ips = node_ips
        self.opts: dict[Family, Options] = {}
        self._probed: Capability | None = None
        self._setup_done = False
        self.installed: dict[ServicePortName, ServicePortState] = {}
        self._fam: dict[Family, FamilyRules] = {f: FamilyRules(f) for f in FAMILIES}
        self._kernel_chains: dict[Family, set[str]] = {f: set() for f in FAMILIES}  # per-ServicePort nat chains
        self._need_full = True
        self._readback: dict[Family, ReadBack] = {}
        self.syncs = self.full_syncs = 0
        self.last_input: dict[Family, str] = {}  # the last restore input per family (tests, bench)
        self._restore_lines = 0  # of every restore input the kernel accepted (kernel_writes)
        self._former: dict[FrontendKey, str] = {}
        self._former_lock = threading.Lock()

    # -- probing and set-up ---------------------------------------------------------------------
    def probe(self) -> Capability:
        """The backend (the node's, backend.choose) takes every match and target of the rules,
        in both families or IPv4 alone. Never raises, and changes nothing: the throwaway chain is
        restored in a network namespace of its own (probe_input), so `usproxy check` leaves the
        node's tables as they were."""
        if self._probed is None:
            self._probed = self._probe()
        return self._probed

    def _probe(self) -> Capability:
        try:
            return Capability(self.name, True, self._choose())
        except Exception as err:
            return Capability(self.name, False, str(err))

    def _choose(self) -> str:
        run = self.client.run_sync
        if self.tools is None:
            backend, self.backend_reason = backends.choose(run, lambda b: self._refusal(Tools(b), 4))
            self.tools = Tools(backend)
        elif (fault := self._refusal(self.tools, 4)) is not None:
            raise LookupError(f"iptables-{self.tools.backend}: {fault}")
        v6 = self._refusal(self.tools, 6)
        self.families = FAMILIES if v6 is None else (4,)
        version = (run([self.tools.command(4), "--version"]) or "").strip()
        note = "" if v6 is None else f"; IPv6 not served ({v6})"
        return f"{version or self.tools.command(4)}: {self.backend_reason}{note}"

    def _refusal(self, tools: Tools, family: Family) -> str | None:
        """Why `tools` cannot restore the rules' matches and targets in `family` (None: it can)."""
        if self._probe_restore(tools, family, probe_input(family)) is None:
            return f"{tools.command(family, 'restore')} refused nat DNAT, statistic, recent, addrtype, mark or REJECT"
        return None

    def _probe_restore(self, tools: Tools, family: Family, text: str) -> str | None:
        """Restore `text` in a network namespace of its own (`unshare --net`: the kernel's matches
        and targets are the same in every namespace, and a fresh one keeps no table iptables-nft
        would create); in place only where unshare is not allowed."""
        out = self.client.run_sync(["unshare", "--net", *tools.restore(family)], text)
        if out is None and self.client.run_sync(["unshare", "--net", "true"]) is None:
            out = self.client.run_sync(tools.restore(family), text)
        return out

    async def _setup(self) -> None:
        """Once: the backend (probe), kube-proxy's nfacct counters, and the namespace's sysctls
        the rules depend on (nf_conntrack_tcp_be_liberal read, route_localnet written)."""
        if self._setup_done:
            return
        loop = asyncio.get_running_loop()
        cap, random_fully = await loop.run_in_executor(None, self._probe_all)
        if not cap.available:
            raise OffloadError(f"iptables unavailable: {cap.detail}")
        if not await loop.run_in_executor(None, self.conntrack.enable_accounting):
            log.info("kernel flows of the iptables datapath carry no byte counts")
        nfacct = await self.client.ensure_nfacct()
        if nfacct is not None:
            log.info("iptables rules count without nfacct (%s)", nfacct)
        liberal = await self.client.sysctl(LIBERAL) == "1"
        localhost = self.localhost_nodeports and await self.client.sysctl(ROUTE_LOCALNET, "1") == "1"
        if self.localhost_nodeports and not localhost:
            log.warning("cannot set %s: NodePorts are not served on 127.0.0.1", ROUTE_LOCALNET)
        for f in self.families:
            self.opts[f] = Options(localhost_nodeports=localhost and f == 4, nfacct=nfacct is None,
                                   random_fully=random_fully, conntrack_tcp_liberal=liberal,
                                   service_address_source=True, hairpin_mark=self.hairpin_mark if f == 4 else 0)
        self._setup_done = True

    def _probe_all(self) -> tuple[Capability, bool]:
        """probe(), and whether MASQUERADE takes --random-fully (iptables 1.6.2 and later)."""
        cap = self.probe()
        if not cap.available or self.tools is None:
            return cap, False
        return cap, self._probe_restore(self.tools, 4, probe_input(4, random_fully=True)) is not None

    # -- KernelDatapath ---------------------------------------------------------------------------
    def unsupported(self, state: ServicePortState) -> str | None:
        """What kube-proxy's iptables rules cannot do here: SCTP (this project's hosts have none),
        a ServicePort annotated roundRobin (`statistic --mode random` picks the endpoint; the
        agent's default roundRobin is served as random, as nftables does for unannotated
        ServicePorts; the registry declares which policies reach here at all), and a ServicePort
        with no ClusterIP of a family this host's iptables/ip6tables serves."""
        sp = state.service_port
        if sp.protocol == "SCTP":
            return "SCTP is served by the relay only"
        if sp.lb_policy == "roundRobin":
            return "lb-policy roundRobin (annotated): iptables picks endpoints at random (statistic)"
        if not any(ip.version in self.families for ip in sp.cluster_ips):
            return "no ClusterIP of a family this host's iptables serves"
        return None

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        """One restore per family; OffloadError when one is refused (that table unchanged)."""
        await self._setup()
        installed = dict(self.installed)
        for spn, st in changes.items():
            if st is None:
                installed.pop(spn, None)
            else:
                installed[spn] = st
        zero_to_n = self._udp_zero_to_n(changes)
        full = self._need_full
        self._need_full = True  # until this sync succeeded
        try:
            await self._sync(installed, set(changes), full)
        except OffloadError as err:
            if full:
                raise
            log.warning("partial iptables sync refused (%s); trying a full one", err)
            await self._sync(installed, set(changes), True)
        self._need_full = False
        removed = self._frontends(self.installed[s] for s in changes if changes[s] is None and s in self.installed)
        self.installed = installed
        if removed:
            with self._former_lock:
                self._former = dict(list({**self._former, **removed}.items())[-FORMER_MAX:])
        if zero_to_n:
            await self.conntrack.delete_udp(orig_dst=zero_to_n)

    async def _sync(self, installed: Mapping[ServicePortName, ServicePortState], changed: set[ServicePortName],
                    full: bool, families: tuple[Family, ...] | None = None) -> None:
        """Write every family (or `families`), then keep what was written as the kernel's state."""
        writes = []
        for f in families or self.families:
            rb = await self._saved(f) if full else None
            node = await self._node(f)
            with gc_paused(len(changed) > LARGE):
                writes.append(self._write(f, node, installed, changed, rb))
        assert self.tools is not None
        for w in writes:
            for text in w.texts:
                await self.client.run(self.tools.restore(w.family), text)
                self._restore_lines += text.count("\n")
            if w.texts:
                self.last_input[w.family] = "".join(w.texts)
        for w in writes:
            self._fam[w.family], self._kernel_chains[w.family] = w.after, w.kernel_chains
        self.syncs += 1
        self.full_syncs += full

    async def _saved(self, family: Family) -> ReadBack:
        """What the kernel holds, from the last read back when it was just taken."""
        rb = self._readback.pop(family, None)
        if rb is not None:
            return rb
        assert self.tools is not None
        return read(parse(await self.client.run(self.tools.save(family))))

    async def _node(self, family: Family) -> Node:
        """The node as the `family` proxier sees it now."""
        match_all = self.node.nodeport_match_all(family)
        nodeport_ips: tuple[IPAddress, ...] | None = None
        if not match_all and self._addresses is not None:
            local = await self._addresses()
            nodeport_ips = tuple(ip for ip in self.node.nodeport_ips(local, self.clusterip_interface)
                                 if ip.version == family)
        return Node(self.node.name, tuple(ip for ip in self.node_ips() if ip.version == family),
                    nodeport_ips=nodeport_ips if not match_all else None, nodeport_match_all=match_all,
                    detector=self.node.detector, masquerade_all=self.node.masquerade_all)

    def _write(self, family: Family, node: Node, installed: Mapping[ServicePortName, ServicePortState],
               changed: set[ServicePortName], rb: ReadBack | None) -> _Write:
        """The restore input of one family and the state it leaves (rb: a full sync's read)."""
        before = self._fam[family]
        after, redone = before.updated(node, self.opts[family], installed, changed)
        if rb is None and redone is not None and not redone:  # nothing of this family changed
            return _Write(family, [], before, self._kernel_chains[family])
        kernel = rb.service_chains if rb is not None else self._kernel_chains[family]
        assert self.tools is not None
        chunk = family_rules.CHUNK if self.tools.backend == "nft" else None  # FamilyRules.writes says why
        inputs = after.writes(None if rb is not None else redone, kernel - after.chains, chunk)
        if rb is not None:
            tables = inputs[-1]
            rs = after.ruleset()
            assert rs is not None
            for w in tables:
                w.edits = _missing_jumps(rs, w.table, rb)
            mangle = TableWrite("mangle")
            for w in (mangle, *tables):  # created, or flushed while empty
                w.chains.append(names.CANARY)
            tables.append(mangle)
        return _Write(family, [render(t) for t in inputs], after, set(after.chains))

    def _udp_zero_to_n(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> set[tuple[str, int]]:
        """UDP frontends of installed ServicePorts that refused until now and get endpoints in
        this change: kube-proxy deletes their conntrack entries, so a sender's earlier 'refused'
        flow does not stick (CleanStaleEntries, newly active UDP services)."""
        out = set()
        for spn, st in changes.items():
            prev = self.installed.get(spn)
            if st is None or prev is None or spn.protocol != "UDP":
                continue
            sp = st.service_port
            if not prev.cluster_endpoints and st.cluster_endpoints:
                out |= {(str(ip), sp.port) for ip in sp.cluster_ips}
            if not prev.external_endpoints and st.external_endpoints:
                out |= {(str(ip), sp.port) for ip in (*sp.external_ips, *sp.load_balancer_ips)}
        return out

    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        """The ServicePorts this family's rules name, with their DNAT destinations; installs the
        skeleton where the kernel holds none (module docstring)."""
        await self._setup()
        assert self.tools is not None
        out: dict[ServicePortName, set[Endpoint]] = {}
        missing = []
        for f in self.families:
            rb = read(parse(await self.client.run(self.tools.save(f))))
            self._readback[f] = rb
            self._kernel_chains[f] = set(rb.service_chains)
            for spn, eps in rb.ports.items():
                out.setdefault(spn, set()).update(eps)
            if not rb.top_chains:
                missing.append(f)
        self._need_full = True  # the next sync adopts or repairs what was read
        if missing:  # nothing to adopt there: the skeleton now, so conntrack tracks from now on
            log.info("installing the iptables skeleton (IPv%s)", "/".join(map(str, missing)))
            await self._sync(self.installed, set(), True, tuple(missing))
        return {spn: tuple(sorted(eps)) for spn, eps in out.items()}

    async def reconcile_udp(self, rule: StaleUdp) -> None:
        """Delete the UDP conntrack entries `rule` calls stale, as kube-proxy's CleanStaleEntries."""
        await reconcile_logged(self.conntrack, rule)

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        await delete_removed_udp_endpoints(self.conntrack, removed)

    def frontends(self) -> dict[FrontendKey, str]:
        """(address or "*", PROTO, port) -> ServicePortName text of what the rules hold."""
        return self._frontends(self.installed.values())

    @staticmethod
    def _frontends(states: Iterable[ServicePortState]) -> dict[FrontendKey, str]:
        out: dict[FrontendKey, str] = {}
        for st in states:
            sp = st.service_port
            for ip in (*sp.cluster_ips, *sp.external_ips, *sp.load_balancer_ips):
                out[(str(ip), sp.protocol, sp.port)] = sp.name.key()
            if sp.node_port:
                out[("*", sp.protocol, sp.node_port)] = sp.name.key()
        return out

    def flows_view(self) -> list[FlowRow]:
        """DNATed conntrack entries of the frontends the rules hold, and of frontends taken out
        while their entries live on (a demoted ServicePort's kernel flows run on)."""
        current, former = self.frontends(), dict(self._former)
        rows = self.conntrack.flows({**former, **current}, self.name)
        seen = {r["service"] for r in rows}
        gone = {k for k, v in former.items() if k in current or v not in seen}
        with self._former_lock:
            self._former = {k: v for k, v in self._former.items() if k not in gone}
        return rows

    def dump(self) -> str:
        """The restore input of every family as explain renders it (rules.render_ruleset)."""
        out = []
        for f in FAMILIES:
            rs = self._fam[f].ruleset()
            if rs is not None and self.installed:
                out.append(f"# IPv{f}\n" + render_ruleset(rs).rstrip("\n"))
        return "\n".join(out)

    def ruleset(self, family: Family) -> Ruleset | None:
        """The rules the kernel holds for `family` (after the last sync)."""
        return self._fam[family].ruleset()

    async def cleanup(self) -> None:
        """Delete this mode's jumps and chains from both families of both backends, leaving
        every other program's rules (leftovers.py). Raises OffloadError naming what failed."""
        errors = []
        for b in backends.BACKENDS:
            tools = Tools(b)
            for f in FAMILIES:
                try:
                    text = await self.client.run(tools.save(f))
                except OffloadError:
                    continue  # that backend or family does not work here: nothing of ours in it
                writes = render(removal(parse(text)))
                if not writes:
                    continue
                try:
                    await self.client.run(tools.restore(f), writes)
                    self._restore_lines += writes.count("\n")
                except OffloadError as err:
                    errors.append(str(err))
        self.installed, self._fam = {}, {f: FamilyRules(f) for f in FAMILIES}
        self._kernel_chains = {f: set() for f in FAMILIES}
        self._need_full = True
        if errors:
            raise OffloadError("; ".join(errors))

    def kernel_writes(self) -> int:
        """Lines of every iptables-restore input the kernel accepted (KernelWriteCounter)."""
        return self._restore_lines

    async def leftovers(self) -> list[str]:
        """What this mode holds in either backend and family (leftovers.describe), changing
        nothing: an agent that does not use the iptables datapath removes it at start."""
        out = []
        for b in backends.BACKENDS:
            for f in FAMILIES:
                try:
                    text = await self.client.run(Tools(b).save(f))
                except OffloadError:
                    continue
                what = describe(b, f, parse(text))
                if what is not None:
                    out.append(what)
        return out

    def close(self) -> None:
        """Stop the worker threads; the rules stay (field case C20)."""
        self.client.close()
        self.conntrack.close()
        if self._addr_worker is not None:
            self._addr_worker.close()


def _missing_jumps(rs: Ruleset, table: str, rb: ReadBack) -> list[str]:
    """`-I BASE 1 ...` for each entry jump to a chain of `rs` that the kernel lacks, in the order
    kube-proxy ensures them (each insert goes to the top), then usproxy's jumps.LOCAL_CLUSTER_IPS."""
    have = rb.builtin_rules.get(table, set())
    out = []
    for j in DATAPATH_JUMPS:
        if j.table == table and j.target in rs.chains[j.table] and j.text() not in have:
            out.append(j.text().replace(f"-A {j.base} ", f"-I {j.base} 1 ", 1))
    return out


def probe_input(family: Family, random_fully: bool = False) -> str:
    """A throwaway chain in nat and filter with every match and target the rules use, created
    and deleted in one restore: nothing stays."""
    dst, to = ("10.96.0.1", "10.244.0.1:80") if family == 4 else ("fd00:10:96::1", "[fd00:10:244::1]:80")
    c = PROBE_CHAIN
    nat = [f'-A {c} -m comment --comment "usproxy probe" -m tcp -p tcp -d {dst} --dport 80 '
           f"-m statistic --mode random --probability 0.5000000000 -j DNAT --to-destination {to}",
           f"-A {c} -m recent --name {c} --rcheck --seconds 10800 --reap -j RETURN",
           f"-A {c} -m recent --name {c} --set -m addrtype --src-type LOCAL -j MARK --or-mark 0x4000",
           f"-A {c} -m mark ! --mark 0x4000/0x4000 -j MASQUERADE" + (" --random-fully" if random_fully else "")]
    filt = [f"-A {c} -m conntrack --ctstate INVALID -j DROP", f"-A {c} -m udp -p udp -j REJECT"]
    lines = []
    for table, rules in (("nat", nat), ("filter", filt), ("mangle", [])):
        lines += [f"*{table}", f":{c} - [0:0]", *rules, f"-F {c}", f"-X {c}", "COMMIT"]
    return "\n".join(lines) + "\n"
