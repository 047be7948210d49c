"""`usproxy explain diff OLD NEW`: what one change of the Services does to each mode's own rules.

Two ServiceSets (before, after) are rendered by each mode's view and compared as a unified diff,
with the count of lines added and removed. Lines are compared with their blank padding aside,
so a table re-aligned around one changed row counts that row only. For the two modes whose sync
kube-proxy sizes in its tests, what it really sends is written out and counted too
(pkg/proxy/*/proxier_test.go TestSyncProxyRulesRepeated): iptables, the lines of the partial
iptables-restore (cost.iptables_partial_restore over the changed ServicePorts, with a chain line
and an `-X` line per chain deleted); nftables, the operations of the transaction: each element
added or removed, each chain of a changed ServicePort added, flushed and refilled (cost.
nftables_rewritten), each chain no longer used flushed (kube-proxy deletes it later, in a
transaction of its own). For UDP, the conntrack entries
kube-proxy deletes are listed (pkg/proxy/conntrack/cleanup.go): flows DNATed to a removed endpoint,
and flows to a ClusterIP that had no endpoint. Invariant: values in, text out; no I/O.
"""

from __future__ import annotations

import difflib
import re
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


def unpadded(text: str) -> str:
    """`text` with each run of blanks made one: a table column widened by a longer cell (the
    userspace view's endpoint lists) rewrites every row's padding, which no proxier writes."""
    return " ".join(text.split())


def _span(start: int, stop: int) -> str:
    """A unified diff hunk's range, as difflib writes it."""
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start if not length else start + 1},{length}"


def unified(before: str, after: str, mode: str) -> tuple[list[str], int, int]:
    """(unified diff lines, lines added, lines removed) of one mode's two renderings. Lines are
    compared with their blank padding aside (unpadded), so a table re-aligned around one changed
    row counts that row only; the lines shown are the renderings' own."""
    a, b = before.splitlines(), after.splitlines()
    matcher = difflib.SequenceMatcher(None, [unpadded(x) for x in a], [unpadded(x) for x in b])
    lines, added, removed = [f"--- OLD ({mode})", f"+++ NEW ({mode})"], 0, 0
    for group in matcher.get_grouped_opcodes(1):
        lines.append(f"@@ -{_span(group[0][1], group[-1][2])} +{_span(group[0][3], group[-1][4])} @@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                lines += [f" {x}" for x in b[j1:j2]]
                continue
            if tag in ("replace", "delete"):
                lines += [f"-{x}" for x in a[i1:i2]]
                removed += i2 - i1
            if tag in ("replace", "insert"):
                lines += [f"+{x}" for x in b[j1:j2]]
                added += j2 - j1
    return (lines if added + removed else []), added, removed


def _families(old: ServiceSet, new: ServiceSet) -> tuple[Family, ...]:
    return tuple(f for f in (4, 6) if f in old.families() or f in new.families())


def iptables_restore(old: ServiceSet, new: ServiceSet, opts: iptables.Options = iptables.Options()) -> list[str]:
    """kube-proxy's partial iptables-restore input for this change, per family (IPv6's after
    IPv4's): the changed ServicePorts' chains, the top-level chains and the filter table, and an
    `-X` for each chain no longer used (cost.iptables_partial_restore); `opts`: the node's
    iptables (iptables.Options)."""
    names, out = changed(old, new), []
    for family in _families(old, new):
        rs_old, rs_new = iptables.build(old, family, opts), iptables.build(new, family, opts)
        fps = [fp for fp in new.family_ports(family) if fp.name in names]
        deleted = [c for c in rs_old.chains["nat"] if c not in set(rs_new.chains["nat"])]
        out += cost.iptables_partial_restore(rs_new, fps, deleted)
    return out


def iptables_sends(old: ServiceSet, new: ServiceSet) -> int:
    """Lines of kube-proxy's partial iptables-restore for this change, summed over families."""
    return len(iptables_restore(old, new))


def _element_lines(t: nftables.Table) -> set[str]:
    return {line for line in nftables.dump(t).splitlines() if line.startswith("add element")}


_ELEMENT = re.compile(r"^add element (\S+ \S+ \S+) \{ (.*?)(?: comment \"[^\"]*\")?(?: : .*)? \}$")


def _deleted(line: str) -> str:
    """An `add element` line as the `delete element` that removes it (the key alone)."""
    m = _ELEMENT.match(line)
    return f"delete element {m[1]} {{ {m[2]} }}" if m else "delete" + line[len("add"):]


def nftables_transaction(old: ServiceSet, new: ServiceSet) -> list[str]:
    """kube-proxy's nftables transaction for this change, per family, in the dump's words: each
    element removed and added, each chain of a changed ServicePort added, flushed and refilled
    and each of its affinity sets added (cost.nftables_rewritten), each chain no longer used
    flushed (kube-proxy deletes it later, in a transaction of its own)."""
    names, out = changed(old, new), []
    for family in _families(old, new):
        t_old, t_new = nftables.build(old, family), nftables.build(new, family)
        dump = nftables.dump(t_new).splitlines()
        prefix = f"{t_new.ipx} {nftables.TABLE}"
        was, now = _element_lines(t_old), _element_lines(t_new)
        out += [_deleted(line) for line in sorted(was - now)] + sorted(now - was)
        for fp in new.family_ports(family):
            if fp.name not in names:
                continue
            chains, sets = cost.nftables_rewritten(t_new, fp)
            out += [line for line in dump for s in sets if line.startswith(f"add set {prefix} {s} ")]
            for c in chains:
                out += [f"add chain {prefix} {c}", f"flush chain {prefix} {c}"]
                out += [line for line in dump if line.startswith(f"add rule {prefix} {c} ")]
        out += [f"flush chain {prefix} {c}" for c in t_old.chains if c not in t_new.chains]
    return out


def nftables_sends(old: ServiceSet, new: ServiceSet) -> int:
    """Operations of kube-proxy's nftables transaction for this change, summed over families."""
    return len(nftables_transaction(old, new))


def iptables_sends_text(old: ServiceSet, new: ServiceSet) -> str:
    """iptables_sends in --scale's table."""
    return f"{iptables_sends(old, new)} lines of iptables-restore (partial sync)"


def iptables_sends_note(old: ServiceSet, new: ServiceSet) -> str:
    """Under `explain diff`'s heading: the size of kube-proxy's partial iptables-restore, then
    its lines."""
    lines = iptables_restore(old, new)
    return "\n".join([f"{len(lines)} lines of iptables-restore (partial sync: filter table, nat "
                      "top-level chains, the changed Services' chains):", *lines])


def nftables_sends_text(old: ServiceSet, new: ServiceSet) -> str:
    """nftables_sends in --scale's table."""
    return f"{nftables_sends(old, new)} operations in one transaction"


def nftables_sends_note(old: ServiceSet, new: ServiceSet) -> str:
    """Under `explain diff`'s heading: the size of kube-proxy's nftables transaction, then its
    operations."""
    ops = nftables_transaction(old, new)
    return "\n".join([f"{len(ops)} operations in one nftables transaction:", *ops])


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
            head, *sent = mode.diff_sends(old, new).split("\n")
            out += [f"# kube-proxy sends: {head}", *(f"#   {line}" for line in sent)]
        out += [*lines, ""]
    deletes = conntrack_deletes(old, new)
    if deletes:
        out += ["# stale UDP flows kube-proxy deletes (iptables, ipvs and nftables modes):",
                *deletes, ""]
    return "\n".join(out)
