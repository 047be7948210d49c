"""Why, in numbers: what a new connection costs and what one endpoint change rewrites, per mode.

First-packet costs come from `trace` (rules evaluated and lookups made, for a pod reaching each
ClusterIP; mean and worst over the ServicePorts). Change costs count what each proxier writes
when one endpoint of one ServicePort (the largest) is added: iptables rewrites every top-level chain
and the filter table in full plus that Service's own chains (kube-proxy's partial sync, counted in
iptables-restore lines with the `*table` and COMMIT lines), nftables adds, flushes and refills each
of that Service's chains, endpoint chains included, in one transaction (both equal kube-proxy's own
counts on its TestSyncProxyRulesRepeated states, tests/explain/test_partial_sync.py), IPVS adds one real
server, a BPF load balancer writes one backend, one slot and the slot-0 count, a relay writes
nothing to the kernel. For iptables, each `-m statistic` probability is shown beside the share of
new connections its endpoint really gets: rule i of n matches with 1/(n-i) of what reaches it, and
(n-i)/n reaches it, so every endpoint gets 1/n.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from fractions import Fraction

from usproxy.explain import iptables, nftables
from usproxy.explain import chain_names as names
from usproxy.explain.chain_names import nft_base, nft_endpoint_base
from usproxy.explain.service_set import FamilyPort, ServiceSet
from usproxy.explain.trace import Packet, Path, trace_iptables, trace_nftables
from usproxy.table import render_table
from usproxy.types import IPAddress

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


def _first_packet(ss: ServiceSet, tracer: object) -> tuple[float, int, float]:
    """Mean rules, worst rules, mean lookups for a pod reaching each ClusterIP."""
    rules, lookups, worst = [], [], 0
    for family in ss.families():
        for fp in ss.family_ports(family):
            pkt = Packet(_pod_source(fp, ss), fp.cluster_ip, fp.sp.port, fp.sp.protocol)
            paths: list[Path] = tracer(ss, pkt)  # type: ignore[operator]
            rules.append(float(sum(p.share * p.rules for p in paths)))
            lookups.append(float(sum(p.share * p.lookups for p in paths)))
            worst = max([worst, *(p.rules for p in paths)])
    if not rules:
        return 0.0, 0, 0.0
    return sum(rules) / len(rules), worst, sum(lookups) / len(lookups)


PER_SERVICE_CHAINS = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")


def iptables_partial_lines(rs: iptables.Ruleset, fps: Iterable[FamilyPort], deleted: int = 0) -> int:
    """iptables-restore lines of the partial sync that rewrites the chains of `fps`, as kube-proxy
    writes it (pkg/proxy/iptables/proxier.go syncProxyRules with tryPartialSync): the filter table
    in full, the nat table's top-level chains in full, and only the KUBE-SVC/SVL/EXT/SEP chains of
    `fps`; each table as `*table`, its chain lines, its rules and COMMIT; plus a chain line and an
    `-X` line for each of `deleted` chains no longer used. On kube-proxy's
    TestSyncProxyRulesRepeated states this is its golden's line count (32 after svc3 is added)."""
    own: set[str] = set()
    for fp in fps:
        own |= {names.svc_chain(fp.name), names.svl_chain(fp.name), names.ext_chain(fp.name),
                *(names.sep_chain(fp.name, ep) for ep in fp.reachable)}
    nat = [c for c in rs.chains["nat"] if c in own or not c.startswith(PER_SERVICE_CHAINS)]
    filter_lines = 2 + len(rs.chains["filter"]) + sum(1 for r in rs.rules if r.table == "filter")
    nat_rules = sum(len(rs.in_chain("nat", c)) for c in nat)
    return filter_lines + 2 + len(nat) + nat_rules + 2 * deleted


def _iptables_change(ss: ServiceSet) -> tuple[int, int]:
    """(lines of the partial sync that rewrites the largest ServicePort, lines of a full sync),
    summed over the IP families (each family's proxier writes its own)."""
    worst = full = 0
    for family in ss.families():
        rs = iptables.build(ss, family)
        full += len(iptables.render_ruleset(rs).splitlines())
        worst += max((iptables_partial_lines(rs, (fp,)) for fp in ss.family_ports(family)), default=0)
    return worst, full


def nftables_ops(t: nftables.Table, fp: FamilyPort) -> int:
    """Operations of the transaction that rewrites `fp`'s chains after one of its endpoints
    changed, as kube-proxy's nftables mode sends it: each of its service/local/external and
    endpoint chains is added, flushed and refilled (2 + rules), and each endpoint's affinity set is
    added. The sets' and maps' elements do not change then. On kube-proxy's
    TestSyncProxyRulesRepeated state after "add an endpoint to a service" this is the 12
    operations its test counts (pkg/proxy/nftables/proxier_test.go)."""
    base = nft_base(fp.name)
    chains = [f"{kind}-{base}" for kind in ("service", "local", "external")]
    eps = [nft_endpoint_base(fp.name, ep) for ep in fp.reachable]
    chains += [f"endpoint-{e}" for e in eps]
    ops = sum(2 + len(t.chains[c].rules) for c in chains if c in t.chains)
    return ops + sum(1 for e in eps if f"affinity-{e}" in t.containers)


def _nftables_change(ss: ServiceSet) -> int:
    """Operations of the transaction after one endpoint change of the largest ServicePort."""
    return sum(max((nftables_ops(t, fp) for fp in ss.family_ports(family)), default=0)
               for family in ss.families() for t in (nftables.build(ss, family),))


ALL_MODES = ("userspace", "iptables", "ipvs", "nftables", "bpf")


def render(ss: ServiceSet, modes: tuple[str, ...] = ALL_MODES) -> str:
    """The numbers table, one or two rows per mode of `modes` (userspace: kube-proxy 1.0 and
    usproxy's relay), then the iptables probability ladders when iptables is among them."""
    rows = [row for mode in ALL_MODES if mode in modes for row in _rows(ss, mode)]
    out = ["# Why, in numbers (a pod opening a new connection to each ClusterIP; one endpoint added)",
           render_table(["MODE", "FIRST PACKET OF A NEW CONNECTION", "ONE ENDPOINT CHANGE WRITES"], rows)]
    if "iptables" in modes:
        out += ["", "# iptables: each rule's probability and the share of new connections it really gets"]
        out += _ladders(ss)
    return "\n".join(out) + "\n"


def _rows(ss: ServiceSet, mode: str) -> list[list[str]]:
    """The table rows of one mode; only that mode's renderer and tracer run."""
    if mode == "userspace":
        n_ports = sum(len(ss.family_ports(f)) for f in ss.families())
        return [["userspace (1.0)", f"~{(n_ports + 1) / 2:.1f} portal rules, then a copy through userspace",
                 "0 (in-memory list)"],
                ["usproxy relay", "1 socket lookup (ClusterIP is a local address), then a copy",
                 "0 kernel writes"]]
    if mode == "iptables":
        ipt_mean, ipt_worst, _ = _first_packet(ss, trace_iptables)
        ipt_lines, ipt_full = _iptables_change(ss)
        return [["iptables", f"{ipt_mean:.1f} rules (worst {ipt_worst}), linear in Services",
                 f"{ipt_lines} lines of iptables-restore (full sync: {ipt_full})"]]
    if mode == "ipvs":
        return [["ipvs", "2 iptables rules + 2 ipset lookups + 1 IPVS hash lookup",
                 "1 real server (+1 ipset entry if local)"]]
    if mode == "nftables":
        nft_mean, nft_worst, nft_lookups = _first_packet(ss, trace_nftables)
        return [["nftables", f"{nft_mean:.1f} rules (worst {nft_worst}), {nft_lookups:.1f} map lookups",
                 f"{_nftables_change(ss)} commands in one transaction"]]
    return [["bpf", "0 rules, 3 map lookups at connect()", "3 map elements (backend, slot, slot-0 count)"]]


def _ladders(ss: ServiceSet) -> list[str]:
    out, seen = [], set()
    for family in ss.families():
        for fp in ss.family_ports(family):
            n = len(fp.cluster)
            if n < 2 or (fp.name, n) in seen:
                continue
            seen.add((fp.name, n))
            rows = [[f"{fp.name} -> {ep}", text, str(reach), str(share)]
                    for ep, (text, reach, share) in zip(fp.cluster, ladder(n))]
            out.append(render_table(["RULE", "--probability", "REACHES IT", "REALLY GETS"], rows))
    return out or ["(no ServicePort has more than one endpoint)"]
