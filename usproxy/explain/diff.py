"""`usproxy explain diff OLD NEW`: what one change of the Services does to each mode's own rules.

Two ServiceSets (before, after) are rendered by each mode's view and compared as a unified diff,
with the count of lines added and removed. For the two modes whose sync kube-proxy sizes in its
tests, the size of what it really sends is computed too (pkg/proxy/*/proxier_test.go
TestSyncProxyRulesRepeated): iptables, the lines of the partial iptables-restore (cost.
iptables_partial_lines over the changed ServicePorts, plus two lines per chain deleted); nftables,
the operations of the transaction: each element added or removed, each chain of a changed
ServicePort added, flushed and refilled (cost.nftables_ops), each chain no longer used flushed
(kube-proxy deletes it later, in a transaction of its own). For UDP, the conntrack entries
kube-proxy deletes are listed (pkg/proxy/conntrack/cleanup.go): flows DNATed to a removed endpoint,
and flows to a ClusterIP that had no endpoint. Invariant: values in, text out; no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

from usproxy.explain import cost, nftables
from usproxy.offload.iptables import rules as iptables
from usproxy.explain.mode import Mode
from usproxy.model.service_set import ServiceSet
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.service_port import ServicePort
from usproxy.model.types import Family, ServicePortName

View = Callable[[ServiceSet, Mode], str]  # (service set, mode) -> that mode's rendered text


def _ports(ss: ServiceSet) -> dict[ServicePortName, tuple[ServicePort, tuple[Endpoint, ...]]]:
    return {sp.name: (sp, eps) for sp, eps in ss.ports}


def changed(old: ServiceSet, new: ServiceSet) -> set[ServicePortName]:
    """ServicePorts added, removed, or whose spec or endpoints differ."""
    a, b = _ports(old), _ports(new)
    return {name for name in a.keys() | b.keys() if a.get(name) != b.get(name)}


def describe(old: ServiceSet, new: ServiceSet) -> list[str]:
    """One line per change: a ServicePort added or removed, an endpoint added, removed, or whose
    readiness changed, a spec changed."""
    a, b = _ports(old), _ports(new)
    out = []
    for name in sorted(changed(old, new)):
        if name not in a or name not in b:
            out.append(f"{name}: Service port {'added' if name in b else 'removed'}")
            continue
        (sp_a, eps_a), (sp_b, eps_b) = a[name], b[name]
        if sp_a != sp_b:
            out.append(f"{name}: Service spec changed")
        was, now = {str(ep): ep for ep in eps_a}, {str(ep): ep for ep in eps_b}
        out += [f"{name}: endpoint {ep} added" for ep in sorted(now.keys() - was.keys())]
        out += [f"{name}: endpoint {ep} removed" for ep in sorted(was.keys() - now.keys())]
        out += [f"{name}: endpoint {ep} {'ready' if now[ep].ready else 'not ready'}"
                for ep in sorted(was.keys() & now.keys()) if was[ep].ready != now[ep].ready]
    return out


def unified(before: str, after: str, mode: str) -> tuple[list[str], int, int]:
    """(unified diff lines, lines added, lines removed) of one mode's two renderings."""
    lines = list(difflib.unified_diff(before.splitlines(), after.splitlines(),
                                      f"OLD ({mode})", f"NEW ({mode})", lineterm="", n=1))
    body = [line for line in lines[2:] if not line.startswith("@@")]
    return lines, sum(1 for x in body if x.startswith("+")), sum(1 for x in body if x.startswith("-"))


def _families(old: ServiceSet, new: ServiceSet) -> tuple[Family, ...]:
    return tuple(f for f in (4, 6) if f in old.families() or f in new.families())


def iptables_sends(old: ServiceSet, new: ServiceSet) -> int:
    """Lines of kube-proxy's partial iptables-restore for this change, summed over families."""
    names, total = changed(old, new), 0
    for family in _families(old, new):
        rs_old, rs_new = iptables.build(old, family), iptables.build(new, family)
        fps = [fp for fp in new.family_ports(family) if fp.name in names]
        deleted = set(rs_old.chains["nat"]) - set(rs_new.chains["nat"])
        total += cost.iptables_partial_lines(rs_new, fps, len(deleted))
    return total


def _elements(t: nftables.Table) -> set[str]:
    return {line for line in nftables.dump(t).splitlines() if line.startswith("add element")}


def iptables_sends_text(old: ServiceSet, new: ServiceSet) -> str:
    """iptables_sends in --scale's table."""
    return f"{iptables_sends(old, new)} lines of iptables-restore (partial sync)"


def iptables_sends_note(old: ServiceSet, new: ServiceSet) -> str:
    """iptables_sends under `explain diff`'s heading, with what the partial sync holds."""
    return (f"{iptables_sends(old, new)} lines of iptables-restore (partial sync: filter table, nat "
            "top-level chains, the changed Services' chains)")


def nftables_sends(old: ServiceSet, new: ServiceSet) -> int:
    """Operations of kube-proxy's nftables transaction for this change, summed over families."""
    names, total = changed(old, new), 0
    for family in _families(old, new):
        t_old, t_new = nftables.build(old, family), nftables.build(new, family)
        total += len(_elements(t_old) ^ _elements(t_new))
        total += sum(cost.nftables_ops(t_new, fp) for fp in new.family_ports(family) if fp.name in names)
        total += len(t_old.chains.keys() - t_new.chains.keys())  # flushed now, deleted later
    return total


def nftables_sends_text(old: ServiceSet, new: ServiceSet) -> str:
    """nftables_sends in --scale's table."""
    return f"{nftables_sends(old, new)} operations in one transaction"


def nftables_sends_note(old: ServiceSet, new: ServiceSet) -> str:
    """nftables_sends under `explain diff`'s heading."""
    return f"{nftables_sends(old, new)} operations in one nftables transaction"


def conntrack_deletes(old: ServiceSet, new: ServiceSet) -> list[str]:
    """The UDP conntrack entries kube-proxy deletes after this change (every kernel mode)."""
    a, b = _ports(old), _ports(new)
    out = []
    for name in sorted(a.keys() & b.keys()):
        (sp, eps_a), (_, eps_b) = a[name], b[name]
        if sp.protocol != "UDP":
            continue
        was, now = usable(eps_a), usable(eps_b)
        out += [f"conntrack -D -p udp --orig-dst {ip} --dst-nat {ep.ip}  (flows to {name} DNATed to "
                f"removed endpoint {ep})" for ep in was if ep not in now for ip in sp.cluster_ips]
        if not was and now:
            out += [f"conntrack -D -p udp --orig-dst {ip}  ({name} had no endpoint: flows to it were "
                    "answered by the reject rule and stayed in conntrack)" for ip in sp.cluster_ips]
    return out


def render(old: ServiceSet, new: ServiceSet, modes: Sequence[Mode], view: View,
           titles: dict[str, str]) -> str:
    """The whole `explain diff` output: the change, then per mode its diff and its counts;
    `titles`: each mode's heading by name."""
    what = describe(old, new)
    if not what:
        return "# no change: OLD and NEW hold the same Services and endpoints\n"
    out = ["# the change:", *(f"#   {line}" for line in what), ""]
    for mode in modes:
        lines, added, removed = unified(view(old, mode), view(new, mode), mode.name)
        out.append(f"==== {titles[mode.name]} ====")
        changed = added + removed
        out.append(f"# rendered rules: {changed} line{'s' * (changed != 1)} changed (+{added} -{removed})")
        if mode.diff_sends is not None:
            out.append(f"# kube-proxy sends: {mode.diff_sends(old, new)}")
        out += [*lines, ""]
    deletes = conntrack_deletes(old, new)
    if deletes:
        out += ["# stale UDP flows kube-proxy deletes (iptables, ipvs and nftables modes):",
                *deletes, ""]
    return "\n".join(out)
