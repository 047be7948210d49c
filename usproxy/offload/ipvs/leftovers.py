"""What the IPVS datapath leaves in a network namespace, and its removal: nothing of anyone else's.

As kube-proxy's IPVS cleanupLeftovers (pkg/proxy/ipvs/proxier.go), with one difference: kube-proxy
flushes every IPVS virtual server of the node, usproxy deletes only those its own set
(USPROXY-IPVS, ipsets.py) names, so another program's virtual servers (keepalived's, a second
load balancer's) stay; and at an agent's start (leftovers of a run with another --offload), a
virtual server that still carries connections stays too, with its name: packets of those
connections keep reaching IPVS (their conntrack entries bypass the new datapath's NAT), while the
new datapath catches every new connection before IPVS sees it; a later start, or --cleanup,
removes it once idle. Then the kube-ipvs0 device, this mode's iptables chains and entry jumps
in both backends and families (the iptables datapath's removal, offload/iptables/leftovers.py,
with this mode's chains, jumps and the chains it shares with iptables mode: shared.py), and
last the sets, which no rule refers to by then.
"""

from __future__ import annotations

from usproxy.offload.iptables import backend as backends
from usproxy.offload.iptables.backend import Tools
from usproxy.offload.iptables.client import IptablesTransport
from usproxy.offload.iptables.leftovers import describe as describe_chains
from usproxy.offload.iptables.leftovers import removal
from usproxy.offload.iptables.restore_input import render
from usproxy.offload.iptables.saved import SavedTable, parse
from usproxy.offload.ipvs import ipsets
from usproxy.offload.ipvs.kernel import IpvsKernel, Service
from usproxy.offload.ipvs.rules import FILTER_CHAINS, JUMPS, NAT_CHAINS
from usproxy.model.types import Family
from usproxy.util.errors import OffloadError

FAMILIES: tuple[Family, ...] = (4, 6)


def owned(table: str, chain: str) -> bool:
    """Whether `chain` of `table` is one IPVS mode writes."""
    return chain in (NAT_CHAINS if table == "nat" else FILTER_CHAINS if table == "filter" else ())


async def _sets(kernel: IpvsKernel) -> dict[str, ipsets.SavedSet]:
    try:
        return ipsets.parse_save(await kernel.run(kernel.ipset, ["save"]))
    except OffloadError:
        return {}  # no ipset tool (or no ip_set): no set of ours either


def _ours(kernel: IpvsKernel, saved: dict[str, ipsets.SavedSet]) -> list[Service]:
    names = {e for f in FAMILIES for e in ipsets.names(saved, f)}
    return [svc for svc, _ in kernel.dump() if f"{svc.address},{svc.proto.lower()}:{svc.port}" in names]


async def _saved_tables(tools: IptablesTransport) -> list[tuple[Tools, Family, dict[str, SavedTable]]]:
    out = []
    for b in backends.BACKENDS:
        for f in FAMILIES:
            try:
                text = await tools.run(Tools(b).save(f))
            except OffloadError:
                continue  # that backend or family does not work here: nothing of ours in it
            out.append((Tools(b), f, parse(text)))
    return out


async def _busy(kernel: IpvsKernel, services: list[Service]) -> list[Service]:
    return [s for s in services if any(d.connections for d in await kernel.run(kernel.dests, s.key))]


async def describe(kernel: IpvsKernel, tools: IptablesTransport, keep_busy: bool = False) -> list[str]:
    """What of this mode the namespace holds, changing nothing; with `keep_busy`, what remove()
    with it would remove (the busy virtual servers and the sets naming them left out)."""
    out = []
    saved = await _sets(kernel)
    ours = await kernel.run(_ours, kernel, saved) if saved and await kernel.run(kernel.loaded) else []
    busy = await _busy(kernel, ours) if keep_busy else []
    if len(ours) > len(busy):
        out.append(f"{len(ours) - len(busy)} IPVS virtual servers")
    if await kernel.run(kernel.device_addresses) is not None:
        out.append(f"device {kernel.device}")
    naming = {ipsets.names_set(4 if s.address.version == 4 else 6) for s in busy}
    sets = [n for f in FAMILIES for n in ipsets.owned(f) if n in saved and n not in naming]
    if sets:
        out.append(f"{len(sets)} ipsets")
    for t, f, tables in await _saved_tables(tools):
        what = describe_chains(t.backend, f, tables, owned, other="iptables")
        if what is not None:
            out.append(what)
    return out


async def remove(kernel: IpvsKernel, tools: IptablesTransport, keep_busy: bool = False) -> list[Service]:
    """Remove it (module docstring); with `keep_busy`, the virtual servers that carry
    connections stay. Returns those kept. Raises OffloadError naming what failed."""
    errors = []
    saved = await _sets(kernel)
    kept: list[Service] = []
    try:  # without ip_vs loaded or usproxy's set there is no virtual server of ours
        if saved and await kernel.run(kernel.loaded):
            ours = await kernel.run(_ours, kernel, saved)
            kept = await _busy(kernel, ours) if keep_busy else []
            for svc in ours:
                if svc not in kept:
                    await kernel.run(kernel.del_service, svc.key)
    except OffloadError as err:
        errors.append(str(err))
    try:
        await kernel.run(kernel.delete_device)
    except OffloadError as err:
        errors.append(str(err))
    for t, f, tables in await _saved_tables(tools):
        text = render(removal(tables, owned, JUMPS, other="iptables"))
        if text:
            try:
                await tools.run(t.restore(f), text)
            except OffloadError as err:
                errors.append(str(err))
    naming = {ipsets.names_set(4 if s.address.version == 4 else 6) for s in kept}
    gone = [n for f in FAMILIES for n in ipsets.owned(f) if n in saved and n not in naming]
    if gone:
        try:
            await kernel.run(kernel.ipset, ["-exist", "restore"], "".join(f"flush {n}\ndestroy {n}\n" for n in gone))
        except OffloadError as err:
            errors.append(str(err))
    for name in naming:  # only the kept virtual servers stay named
        entries = {f"{s.address},{s.proto.lower()}:{s.port}" for s in kept}
        stale = [m for m in saved[name].members if m.split(" comment ", 1)[0] not in entries]
        if stale:
            await kernel.run(kernel.ipset, ["-exist", "restore"],
                             "".join(f"del {name} {m.split(' comment ', 1)[0]}\n" for m in stale))
    if errors:
        raise OffloadError("; ".join(errors))
    return kept
