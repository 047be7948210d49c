"""What a socket/tc-BPF load balancer (Cilium's kube-proxy replacement) holds for a ServiceSet.

Modelled on cilium-dbg's `service list` (cilium-dbg/cmd/service_list.go: ID, Frontend, Service
Type, Backend "n => addr/PROTO (active)") and `bpf lb list` (cilium-dbg/cmd/bpf_lb_list.go: one row
per services-map key "addr:port/PROTO (slot)"; slot 0 is the master entry "0.0.0.0:0 (revnat)
(0) [flags]" holding the backend count, slots 1..n point at backends). Frontends: ClusterIP,
ExternalIPs, LoadBalancer, NodePort on 0.0.0.0 (the surrogate) and on each node address. Service
IDs (= reverse-NAT IDs) and backend IDs are allocated in sorted order here; Cilium allocates them
in arrival order, so only the shape, not the numbers, is what a live node shows.

`tc_list` adds what usproxy's own tc programs read for traffic from outside the node (IPv4 only):
the frontends flagged tc-only (the NodePort at 0.0.0.0, LB IPs, externalIPs), their flags, the
usp_tc_sources LPM entries of LB IPs with loadBalancerSourceRanges, the size of each usp_maglev
table, and usp_tc_addrs, as usproxy/offload/bpf/datapath.py `_external_wants` writes them. The
per-backend Maglev shares are left to `explain trace` (a table costs 16381 steps to build).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from usproxy.model.endpoint import Endpoint
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.offload.bpf.layout import MAGLEV_M
from usproxy.model.source_ranges import allowed_sources
from usproxy.model.types import IPAddress, format_hostport


@dataclass(frozen=True, slots=True)
class Frontend:
    id: int
    address: IPAddress
    port: int
    proto: str
    type: str  # ClusterIP, NodePort, ExternalIPs, LoadBalancer
    flags: str
    backends: tuple[Endpoint, ...]
    fp: FamilyPort

    def text(self) -> str:
        return f"{format_hostport(self.address, self.port)}/{self.proto}"


def _flags(fp: FamilyPort, typ: str) -> str:
    out = [typ]
    if typ != "ClusterIP" and fp.external_policy_local:
        out.append("Local")
    if typ == "ClusterIP" and fp.internal_policy_local:
        out.append("InternalLocal")
    if fp.sp.session_affinity == "ClientIP":
        out.append("sessionAffinity")
    if typ == "ClusterIP":
        out.append("non-routable")
    return ", ".join(out)


_Candidate = tuple[IPAddress, int, str, str, tuple[Endpoint, ...], FamilyPort]


def _candidates(ss: ServiceSet) -> list[_Candidate]:
    out: list[_Candidate] = []
    for family in ss.families():
        any_ip = ipaddress.ip_address("0.0.0.0" if family == 4 else "::")
        for fp in ss.family_ports(family):
            p = fp.sp.protocol
            out.append((fp.cluster_ip, fp.sp.port, p, "ClusterIP", fp.internal, fp))
            out += [(ip, fp.sp.port, p, "ExternalIPs", fp.external, fp) for ip in fp.external_ips]
            out += [(ip, fp.sp.port, p, "LoadBalancer", fp.external, fp) for ip in fp.lb_ips]
            if fp.sp.node_port:
                out += [(ip, fp.sp.node_port, p, "NodePort", fp.external, fp)
                        for ip in (any_ip, *ss.node.ips_of(family))]
    return out


def frontends(ss: ServiceSet) -> list[Frontend]:
    cands = sorted(_candidates(ss), key=lambda c: (c[0].version, c[0].packed, c[1], c[2]))
    return [Frontend(i, ip, port, proto, typ, _flags(fp, typ), eps, fp)
            for i, (ip, port, proto, typ, eps, fp) in enumerate(cands, start=1)]


def _tabulate(rows: list[list[str]], pad: int = 3) -> str:
    """Go text/tabwriter with padding 3, every cell tab-terminated (trailing blanks trimmed)."""
    widths = [max(len(r[i]) for r in rows) + pad for i in range(len(rows[0]))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"


def service_list(fes: list[Frontend]) -> str:
    rows = [["ID", "Frontend", "Service Type", "Backend"]]
    for fe in fes:
        bes = [f"{i} => {format_hostport(b.ip, b.port)}/{fe.proto} "
               f"({'terminating' if b.terminating else 'active'})" for i, b in enumerate(fe.backends, 1)]
        rows.append([str(fe.id), fe.text(), fe.type, bes[0] if bes else ""])
        rows += [["", "", "", b] for b in bes[1:]]
    return _tabulate(rows)


def backend_ids(fes: list[Frontend]) -> dict[tuple[str, str], int]:
    """One backend ID per distinct backend address and protocol (IDs shared across frontends)."""
    keys = sorted({(str(b), fe.proto) for fe in fes for b in fe.backends})
    return {k: i for i, k in enumerate(keys, start=1)}


def lb_list(fes: list[Frontend]) -> str:
    rows = [["SERVICE ADDRESS", "BACKEND ADDRESS (REVNAT_ID) (SLOT)"]]
    entries = []
    for fe in fes:
        zero = "0.0.0.0" if fe.address.version == 4 else "[::]"
        entries.append((f"{fe.text()} (0)", f"{zero}:0 ({fe.id}) (0) [{fe.flags}]"))
        for slot, b in enumerate(fe.backends, start=1):
            entries.append((f"{fe.text()} ({slot})",
                            f"{format_hostport(b.ip, b.port)}/{fe.proto} ({fe.id}) ({slot})"))
    rows += [[k, v] for k, v in sorted(entries)]
    return _tabulate(rows)


TC_TYPES = ("NodePort", "ExternalIPs", "LoadBalancer")


def tc_sources(ss: ServiceSet, fe: Frontend) -> tuple[str, ...]:
    """usp_tc_sources for an LB IP frontend (empty: every source), as the datapath computes them."""
    if fe.type != "LoadBalancer" or not fe.fp.firewalled:
        return ()
    return tuple(map(str, allowed_sources(fe.fp.source_ranges, 4, fe.fp.lb_ips, ss.node.ips)))


def _tc_flags(ss: ServiceSet, fe: Frontend) -> str:
    fp = fe.fp
    out = ["tc-only", "maglev"]
    if fp.external_policy_local:
        out.append("local-only")
        if not fe.backends and fp.cluster:
            out.append("drop-empty")
    if fp.sp.session_affinity == "ClientIP":
        out.append("affinity")
    if tc_sources(ss, fe):
        out.append("source-ranges")
    return ", ".join(out)


def tc_list(ss: ServiceSet, fes: list[Frontend]) -> str:
    """usproxy's tc frontends: one row per usp_services entry flagged tc-only (see the docstring)."""
    rows = [["SERVICE ADDRESS", "FLAGS", "SOURCES (usp_tc_sources)", "MAGLEV (usp_maglev)"]]
    for fe in fes:
        if fe.address.version != 4 or fe.type not in TC_TYPES or (
                fe.type == "NodePort" and fe.address != ipaddress.IPv4Address(0)):
            continue
        n = len(fe.backends)
        rows.append([fe.text(), f"[{_tc_flags(ss, fe)}]", ", ".join(tc_sources(ss, fe)) or "any",
                     f"[{fe.id}] {MAGLEV_M} slots over {n} backend{'' if n == 1 else 's'}" if n
                     else "none (no backend)"])
    addrs = ", ".join(str(ip) for ip in ss.node.ips_of(4)) or "(none: no --node-ip)"
    return _tabulate(rows) + f"usp_tc_addrs (the destinations NodePorts are served on): {addrs}\n"


def render(ss: ServiceSet) -> str:
    fes = frontends(ss)
    return (f"# cilium-dbg service list\n{service_list(fes)}\n"
            f"# cilium-dbg bpf lb list\n{lb_list(fes)}\n"
            f"# usproxy's tc frontends (traffic from outside the node, IPv4; --bpf-lb-mode dsr adds "
            f"dsr to every one without local-only)\n{tc_list(ss, fes)}\n"
            f"# usproxy's own BPF maps: rendered by `--live` from a running agent once the BPF "
            f"offload (usproxy/offload/bpf) is active\n")
