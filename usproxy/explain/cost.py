"""Why, in numbers: what a new connection costs and what one endpoint change rewrites, per mode.

First-packet costs come from `trace` (rules evaluated and lookups made, for a pod reaching each
ClusterIP; mean and worst over the ServicePorts). Change costs count what each proxier writes
when one endpoint of one ServicePort (the largest) is added: iptables rewrites every top-level chain
and the filter table in full plus that Service's own chains (kube-proxy's partial sync, counted in
iptables-restore lines with the `*table` and COMMIT lines), nftables adds, flushes and refills each
of that Service's chains, endpoint chains included, in one transaction (both equal kube-proxy's own
counts on its TestSyncProxyRulesRepeated states, tests/explain/test_partial_sync.py); for IPVS
and BPF the largest ServicePort (most endpoints) gets one endpoint more and the two renderings are
compared: real servers and ipset entries in `ipvsadm -Ln` and `ipset save` (one per virtual server
of the Service; KUBE-LOOP-BACK's entry when the endpoint is on this node), BPF backends, slots and
slot-0 counts in `cilium-dbg bpf lb list` (one slot and one count per frontend); a relay writes
nothing to the kernel. The IPVS and BPF first packets are their tracers' too (BPF: a pod of this
node, whose connect() the socket load balancer serves). For iptables, each `-m statistic` probability is shown beside the share of
new connections its endpoint really gets: rule i of n matches with 1/(n-i) of what reaches it, and
(n-i)/n reaches it, so every endpoint gets 1/n.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from fractions import Fraction

from usproxy.explain import bpf, generator, ipvs, nftables
from usproxy.offload.iptables import rules as iptables
from usproxy.model import chain_names as names
from usproxy.model.chain_names import nft_base, nft_endpoint_base
from usproxy.explain.ipvs_trace import parse_ipsets, parse_ipvsadm
from usproxy.explain.mode import Mode
from usproxy.explain.packet import Packet
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.model.types import Family, IPAddress
from usproxy.util.table import render_table

POD_SOURCE_V4 = ipaddress.ip_address("10.255.255.254")
POD_SOURCE_V6 = ipaddress.ip_address("fd00:ffff::fffe")


def ladder(n: int) -> list[tuple[str, Fraction, Fraction]]:
    """For n endpoints: (probability text, share reaching the rule, share it really gets)."""
    out = []
    for i in range(n):
        text = iptables.probability(n - i) if i < n - 1 else "(always)"
        reach = Fraction(n - i, n)
        out.append((text, reach, reach * Fraction(1, n - i)))
    return out


def _pod_source(fp: FamilyPort, ss: ServiceSet) -> IPAddress:
    cidr = ss.node.cluster_cidr(fp.family)
    if cidr is not None:
        return cidr[-2] if cidr.num_addresses > 2 else cidr[0]
    return POD_SOURCE_V4 if fp.family == 4 else POD_SOURCE_V6


def pod_packet(ss: ServiceSet, fp: FamilyPort, local: bool = False) -> Packet:
    """The first packet of a pod's new connection to `fp`'s ClusterIP; `local`: the pod is a
    process of this node (what a BPF socket load balancer serves)."""
    return Packet(_pod_source(fp, ss), fp.cluster_ip, fp.sp.port, fp.sp.protocol, src_local=local)


def first_packet_of(ss: ServiceSet, fp: FamilyPort, mode: Mode) -> tuple[Fraction, int, Fraction]:
    """(Rules, worst rules, lookups) of a pod's new connection to `fp`'s ClusterIP through
    `mode`'s tracer, the mean weighted by each path's share of new connections."""
    paths = mode.trace(ss, pod_packet(ss, fp, mode.traces_pod_at_connect))
    return (sum((p.share * p.rules for p in paths), Fraction(0)), max(p.rules for p in paths),
            sum((p.share * p.lookups for p in paths), Fraction(0)))


def _first_packet(ss: ServiceSet, mode: Mode) -> tuple[float, int, float]:
    """Mean rules, worst rules, mean lookups for a pod reaching each ClusterIP."""
    rules, lookups, worst = [], [], 0
    for family in ss.families():
        for fp in ss.family_ports(family):
            mean, most, looked = first_packet_of(ss, fp, mode)
            rules.append(float(mean))
            lookups.append(float(looked))
            worst = max(worst, most)
    if not rules:
        return 0.0, 0, 0.0
    return sum(rules) / len(rules), worst, sum(lookups) / len(lookups)


PER_SERVICE_CHAINS = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")


def iptables_partial_restore(rs: iptables.Ruleset, fps: Iterable[FamilyPort],
                             deleted: Sequence[str] = ()) -> list[str]:
    """The iptables-restore input of the partial sync that rewrites the chains of `fps`, as
    kube-proxy writes it (pkg/proxy/iptables/proxier.go syncProxyRules with tryPartialSync): the
    filter table in full, the nat table's top-level chains in full, and only the
    KUBE-SVC/SVL/EXT/SEP chains of `fps`; each table as `*table`, its chain lines, its rules and
    COMMIT; each of the `deleted` chains (no longer used) as a chain line and an `-X` line. On
    kube-proxy's TestSyncProxyRulesRepeated states these are its golden's lines (32 after svc3
    is added, tests/explain/test_partial_sync.py)."""
    own: set[str] = set()
    for fp in fps:
        own |= {names.svc_chain(fp.name), names.svl_chain(fp.name), names.ext_chain(fp.name),
                *(names.sep_chain(fp.name, ep) for ep in fp.reachable)}
    lines: list[str] = []
    for table in ("filter", "nat"):
        chains = [(c, rules) for c, rules in iptables.ordered(rs, table)
                  if table == "filter" or c in own or not c.startswith(PER_SERVICE_CHAINS)]
        gone = deleted if table == "nat" else ()
        lines += [f"*{table}", *(f":{c} - [0:0]" for c, _ in chains), *(f":{c} - [0:0]" for c in gone)]
        lines += [r.text() for _, rules in chains for r in rules]
        lines += [*(f"-X {c}" for c in gone), "COMMIT"]
    return lines


def iptables_partial_lines(rs: iptables.Ruleset, fps: Iterable[FamilyPort], deleted: int = 0) -> int:
    """Lines of iptables_partial_restore for `fps`, with `deleted` chains deleted (each a chain
    line and an `-X` line). On kube-proxy's TestSyncProxyRulesRepeated states this is its
    golden's line count (32 after svc3 is added)."""
    return len(iptables_partial_restore(rs, fps)) + 2 * deleted


def _iptables_change(ss: ServiceSet) -> tuple[int, int]:
    """(lines of the partial sync that rewrites the largest ServicePort, lines of a full sync),
    summed over the IP families (each family's proxier writes its own)."""
    worst = full = 0
    for family in ss.families():
        rs = iptables.build(ss, family)
        full += len(iptables.render_ruleset(rs).splitlines())
        worst += max((iptables_partial_lines(rs, (fp,)) for fp in ss.family_ports(family)), default=0)
    return worst, full


def nftables_rewritten(t: nftables.Table, fp: FamilyPort) -> tuple[list[str], list[str]]:
    """(chains, affinity sets) kube-proxy's nftables mode rewrites after one of `fp`'s endpoints
    changed: its service/local/external and endpoint chains that exist, and each endpoint's
    affinity set."""
    base = nft_base(fp.name)
    eps = [nft_endpoint_base(fp.name, ep) for ep in fp.reachable]
    chains = [f"{kind}-{base}" for kind in ("service", "local", "external")] + [f"endpoint-{e}" for e in eps]
    return ([c for c in chains if c in t.chains],
            [f"affinity-{e}" for e in eps if f"affinity-{e}" in t.containers])


def nftables_ops(t: nftables.Table, fp: FamilyPort) -> int:
    """Operations of the transaction that rewrites `fp`'s chains after one of its endpoints
    changed, as kube-proxy's nftables mode sends it: each of its service/local/external and
    endpoint chains is added, flushed and refilled (2 + rules), and each endpoint's affinity set is
    added. The sets' and maps' elements do not change then. On kube-proxy's
    TestSyncProxyRulesRepeated state after "add an endpoint to a service" this is the 12
    operations its test counts (pkg/proxy/nftables/proxier_test.go)."""
    chains, sets = nftables_rewritten(t, fp)
    return sum(2 + len(t.chains[c].rules) for c in chains) + len(sets)


def _nftables_change(ss: ServiceSet) -> int:
    """Operations of the transaction after one endpoint change of the largest ServicePort."""
    return sum(max((nftables_ops(t, fp) for fp in ss.family_ports(family)), default=0)
               for family in ss.families() for t in (nftables.build(ss, family),))


def render(ss: ServiceSet, modes: Sequence[Mode]) -> str:
    """The numbers table, the rows of each mode of `modes` (userspace: kube-proxy 1.0 and
    usproxy's relay), then the lines each mode adds under it (iptables: its probability ladders)."""
    rows = [row for mode in modes for row in mode.cost_rows(ss, mode)]
    out = ["# Why, in numbers (a pod opening a new connection to each ClusterIP; one endpoint added)",
           render_table(["MODE", "FIRST PACKET OF A NEW CONNECTION", "ONE ENDPOINT CHANGE WRITES"], rows)]
    for mode in modes:
        if mode.cost_detail is not None:
            out += ["", *mode.cost_detail(ss)]
    return "\n".join(out) + "\n"


# --- each mode's rows: only that mode's renderer and tracer run ----------------------------------

def userspace_rows(ss: ServiceSet, mode: Mode) -> list[list[str]]:
    n_ports = sum(len(ss.family_ports(f)) for f in ss.families())
    return [["userspace (1.0)", f"~{(n_ports + 1) / 2:.1f} portal rules, then a copy through userspace",
             "0 (in-memory list)"],
            ["usproxy relay", "1 socket lookup (ClusterIP is a local address), then a copy",
             "0 kernel writes"]]


def iptables_rows(ss: ServiceSet, mode: Mode) -> list[list[str]]:
    ipt_mean, ipt_worst, _ = _first_packet(ss, mode)
    ipt_lines, ipt_full = _iptables_change(ss)
    return [[mode.name, f"{ipt_mean:.1f} rules (worst {ipt_worst}), linear in Services",
             f"{ipt_lines} lines of iptables-restore (full sync: {ipt_full})"]]


def ipvs_rows(ss: ServiceSet, mode: Mode) -> list[list[str]]:
    mean, worst, lookups = _first_packet(ss, mode)
    return [[mode.name, f"{mean:.1f} iptables rules (worst {worst}), {lookups:.1f} lookups "
             "(ipsets, then the IPVS service table)", ipvs_sends(ss, _grown(ss))]]


def nftables_rows(ss: ServiceSet, mode: Mode) -> list[list[str]]:
    nft_mean, nft_worst, nft_lookups = _first_packet(ss, mode)
    return [[mode.name, f"{nft_mean:.1f} rules (worst {nft_worst}), {nft_lookups:.1f} map lookups",
             f"{_nftables_change(ss)} commands in one transaction"]]


def bpf_rows(ss: ServiceSet, mode: Mode) -> list[list[str]]:
    mean, _, lookups = _first_packet(ss, mode)
    return [[mode.name, f"{_count(mean)} rules, {_count(lookups)} map lookups at connect()",
             bpf_sends(ss, _grown(ss))]]


def _count(x: float) -> str:
    """A mean as a whole number when it is one, else to one decimal."""
    return f"{x:.0f}" if x == int(x) else f"{x:.1f}"


def _grown(ss: ServiceSet) -> ServiceSet:
    """`ss` with one endpoint added to its largest ServicePort (most endpoints, first by name)."""
    largest = max(ss.ports, key=lambda p: len(p[1]), default=None)
    return ss if largest is None else generator.with_endpoint_added(ss, largest[0].name)


def _families(old: ServiceSet, new: ServiceSet) -> tuple[Family, ...]:
    return tuple(f for f in (4, 6) if f in old.families() or f in new.families())


def ipvs_writes(old: ServiceSet, new: ServiceSet) -> tuple[int, int]:
    """(real servers, ipset entries) added or removed from OLD to NEW, read from the IPVS view's
    `ipvsadm -Ln` and `ipset save`: what kube-proxy's IPVS proxier writes for that change (one
    real server and one ipset entry at a time, pkg/proxy/ipvs/proxier.go syncEndpoint and
    syncIPSetEntries), summed over the IP families."""
    reals = entries = 0
    for family in _families(old, new):
        def servers(ss: ServiceSet) -> set[tuple[tuple[str, str], str]]:
            table = parse_ipvsadm(ipvs.ipvsadm(ipvs.virtual_servers(ss, family)))
            return {(key, real) for key, vs in table.items() for real in vs.reals}

        def members(ss: ServiceSet) -> set[tuple[str, str]]:
            sets = parse_ipsets(ipvs.ipset_save(ss, family))
            return {(name, m) for name, (_, ms) in sets.items() for m in ms}

        reals += len(servers(old) ^ servers(new))
        entries += len(members(old) ^ members(new))
    return reals, entries


def ipvs_sends(old: ServiceSet, new: ServiceSet) -> str:
    """ipvs_writes as text: "1 real server, 1 ipset entry"."""
    reals, entries = ipvs_writes(old, new)
    return f"{reals} real server{'s' * (reals != 1)}, {entries} ipset entr{'ies' if entries != 1 else 'y'}"


def bpf_writes(old: ServiceSet, new: ServiceSet) -> tuple[int, int, int]:
    """(backends, slots, slot-0 counts) written from OLD to NEW, read from the BPF view
    (`cilium-dbg bpf lb list` rows and backend IDs): backends added or removed, backend slots
    whose backend is new, changed or gone, and frontends whose backend count changed (their
    slot-0 entry is rewritten), as a BPF load balancer updates its maps."""
    def slots(ss: ServiceSet) -> dict[tuple[str, int], str]:
        return {(fe.text(), i): str(b) for fe in bpf.frontends(ss) for i, b in enumerate(fe.backends, 1)}

    def counts(ss: ServiceSet) -> set[tuple[str, int]]:
        return {(fe.text(), len(fe.backends)) for fe in bpf.frontends(ss)}

    a, b = slots(old), slots(new)
    written = sum(1 for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    backends = set(bpf.backend_ids(bpf.frontends(old))) ^ set(bpf.backend_ids(bpf.frontends(new)))
    recounted = {fe for fe, _ in counts(old) ^ counts(new)}
    return len(backends), written, len(recounted)


def bpf_sends(old: ServiceSet, new: ServiceSet) -> str:
    """bpf_writes as text: "3 map elements (1 backend, 1 slot, 1 slot-0 count)"."""
    backends, slots, counts = bpf_writes(old, new)
    return (f"{backends + slots + counts} map elements ({backends} backend{'s' * (backends != 1)}, "
            f"{slots} slot{'s' * (slots != 1)}, {counts} slot-0 count{'s' * (counts != 1)})")


def relay_sends(old: ServiceSet, new: ServiceSet) -> str:
    """What the relay (and kube-proxy 1.0) writes for an endpoint change: nothing."""
    return "0 kernel writes (the relay's, and 1.0's, endpoint lists are in memory)"


def ladders(ss: ServiceSet) -> list[str]:
    """Under the table: each iptables rule's probability beside the share it really gets."""
    out = ["# iptables: each rule's probability and the share of new connections it really gets"]
    seen = set()
    for family in ss.families():
        for fp in ss.family_ports(family):
            n = len(fp.cluster)
            if n < 2 or (fp.name, n) in seen:
                continue
            seen.add((fp.name, n))
            rows = [[f"{fp.name} -> {ep}", text, str(reach), str(share)]
                    for ep, (text, reach, share) in zip(fp.cluster, ladder(n))]
            out.append(render_table(["RULE", "--probability", "REACHES IT", "REALLY GETS"], rows))
    return out if len(out) > 1 else [*out, "(no ServicePort has more than one endpoint)"]
