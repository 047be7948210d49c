"""PathDrawing: the SVG picture of the path a new connection to a ClusterIP takes in each mode.

One drawing per (mode, ServicePort as one family sees it): the hops the first packet walks from the
client to a backend (left to right, each hop a box naming the chain, map or program and what it
does there), the backends with their share, and under them the reply path and the source address
the backend sees. Chain names come from usproxy.model.chain_names (kube-proxy's own hashes), so
the drawing and the rules shown next to it name the same chains. The facts drawn, per mode:

- userspace: kube-proxy 1.0 captured the ClusterIP with iptables (KUBE-PORTALS-CONTAINER REDIRECT
  to a per-Service proxy port, pkg/proxy/userspace/proxier.go); usproxy binds the ClusterIP on its
  VIP interface and accepts itself. Either way the proxy dials the backend: two connections, and the
  backend sees the node's address.
- iptables: nat PREROUTING/OUTPUT → KUBE-SERVICES → KUBE-SVC-* (statistic probability) → KUBE-SEP-*
  DNAT; KUBE-POSTROUTING masquerades packets marked 0x4000 (pkg/proxy/iptables/proxier.go).
- ipvs: KUBE-SERVICES matches the KUBE-CLUSTER-IP ipset and accepts; the IPVS virtual server on
  kube-ipvs0 picks a real server (rr) and rewrites the destination ("Masq" is DNAT, not SNAT).
- nftables: nat-prerouting/nat-output → services map (ip . proto . port) → service-* chain (numgen
  random mod N vmap) → endpoint-* chain dnat (pkg/proxy/nftables/proxier.go).
- bpf: a cgroup connect() hook picks a backend and connects the socket to it: no packet is
  rewritten, and getpeername() is rewritten back to the ClusterIP.
Without a usable endpoint each mode refuses the connection at its own place: nothing listens for
the relay (RST), a filter REJECT for iptables, the no-endpoint-services map for nftables, an IPVS
virtual server with no real server, ECONNREFUSED from the BPF connect hook.

Replies ride conntrack in the kernel modes (un-DNATed to ClusterIP:port). Each mode's drawing is
one `Drawer` (its path with endpoints, and the hop where it refuses without one), named by that
mode's record (usproxy/explain/registry.py). Invariant: pure function of its arguments; text is
XML-escaped. Each backend is an SVG group with `data-endpoint="ip:port"`, so the page can mark the
ones that changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html import escape

from usproxy.model.endpoint import Endpoint
from usproxy.model import chain_names
from usproxy.model.service_set import FamilyPort
from usproxy.explain.userspace import proxy_port
from usproxy.model.types import format_hostport

BOX_W, BOX_H, GAP, PAD = 180, 96, 24, 12  # pixels
SLOTS = 4  # hops the widest mode draws: every drawing is as wide, so all scale alike
LINE = 14  # pixels between text lines


@dataclass(frozen=True, slots=True)
class Hop:
    """One box on the forward path: a title and up to four short lines."""

    title: str
    lines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Path:
    """What one mode does with a new connection: hops, backends (label, detail), reply path."""

    hops: tuple[Hop, ...]
    backends: tuple[tuple[Endpoint, str], ...]
    reply: str
    seen_as: str


def _share(n: int) -> str:
    return f"1/{n}" if n else "-"


def _target(fp: FamilyPort) -> str:
    return format_hostport(str(fp.cluster_ip), fp.sp.port) + "/" + fp.proto


def _userspace(fp: FamilyPort, eps: tuple[Endpoint, ...]) -> Path:
    hops = (Hop("client", ("connect()", _target(fp))),
            Hop("capture", ("1.0: KUBE-PORTALS-*", f"REDIRECT → :{proxy_port(fp)}",
                            "usproxy: ClusterIP bound", "on usproxy0, accept()")),
            Hop("relay (usproxy)", ("picks an endpoint", "connect() from the node", "2nd connection",
                                    "copies bytes both ways")))
    return Path(hops, tuple((e, f"round robin {_share(len(eps))}") for e in eps),
                "reply: backend → relay (its own socket) → client socket; no NAT",
                "backend sees: the node's address")


def _iptables(fp: FamilyPort, eps: tuple[Endpoint, ...]) -> Path:
    hops = (Hop("client", ("SYN to", _target(fp))),
            Hop("nat PREROUTING", ("(OUTPUT from the node)", "→ KUBE-SERVICES", "match ClusterIP:port")),
            Hop(chain_names.svc_chain(fp.name), ("KUBE-MARK-MASQ if the", "source is off-cluster",
                                                    "-m statistic random", f"probability ladder of {len(eps)}")),
            Hop("KUBE-SEP-*", ("DNAT to the endpoint", "conntrack remembers", "KUBE-POSTROUTING:",
                               "MASQUERADE if marked")))
    return Path(hops, tuple((e, chain_names.sep_chain(fp.name, e)) for e in eps),
                "reply: conntrack un-DNATs backend → ClusterIP:port (and un-SNATs if masqueraded)",
                "backend sees: the client (the node if masqueraded)")


def _ipvs(fp: FamilyPort, eps: tuple[Endpoint, ...]) -> Path:
    hops = (Hop("client", ("SYN to", _target(fp))),
            Hop("nat PREROUTING", ("→ KUBE-SERVICES", "match-set", "KUBE-CLUSTER-IP", "ACCEPT")),
            Hop("IPVS virtual server", (_target(fp), "on kube-ipvs0 (dummy)", "scheduler rr",
                                        "Masq = DNAT, not SNAT")))
    return Path(hops, tuple((e, f"real server, weight 1 ({_share(len(eps))})") for e in eps),
                "reply: IPVS connection table un-DNATs backend → ClusterIP:port",
                "backend sees: the client (the node if KUBE-MARK-MASQ)")


def _nftables(fp: FamilyPort, eps: tuple[Endpoint, ...]) -> Path:
    base = chain_names.nft_base(fp.name)
    hops = (Hop("client", ("SYN to", _target(fp))),
            Hop("nat-prerouting", ("(nat-output from node)", "jump services", "map ip . proto . port",
                                   "→ goto service-…")),
            Hop("service-" + base[:9], (base[9:][:24], "masq mark if off-cluster",
                                               f"numgen random mod {len(eps) or 1}", "vmap → endpoint-…")),
            Hop("endpoint-…", ("dnat to the endpoint", "conntrack remembers", "nat-postrouting:",
                               "masquerade if marked")))
    return Path(hops,
                tuple((e, "endpoint-" + chain_names.nft_endpoint_base(fp.name, e)[:10] + "…") for e in eps),
                "reply: conntrack un-DNATs backend → ClusterIP:port (and un-SNATs if masqueraded)",
                "backend sees: the client (the node if masqueraded)")


def _bpf(fp: FamilyPort, eps: tuple[Endpoint, ...]) -> Path:
    hops = (Hop("client process", ("connect() to", _target(fp))),
            Hop("cgroup/connect4 hook", ("service map lookup", "pick a backend slot", "rewrite the socket's",
                                         "destination: no NAT")),
            Hop("socket", ("connected to the", "backend directly", "getpeername() says", "ClusterIP:port")))
    return Path(hops, tuple((e, f"backend slot {i + 1}") for i, e in enumerate(eps)),
                "reply: straight from the backend to the socket; nothing to undo",
                "backend sees: the client itself")


@dataclass(frozen=True, slots=True)
class Drawer:
    """One mode's drawing: `path` of a new connection to a ClusterIP given its usable endpoints,
    and `refused`, the hop where that mode refuses a connection when there is none."""

    path: Callable[[FamilyPort, tuple[Endpoint, ...]], Path]
    refused: Hop

    def of(self, fp: FamilyPort) -> Path:
        """The path of a new connection to `fp`'s ClusterIP; without a usable endpoint it ends
        where this mode refuses it."""
        if fp.internal:
            return self.path(fp, fp.internal)
        return Path((self.path(fp, ()).hops[0], self.refused), (),
                    "no reply from a backend: the client is refused", "backend sees: nothing")


# Where a connection to a ServicePort without a usable endpoint ends, per mode.
USERSPACE = Drawer(_userspace, Hop("refused", ("usproxy: nothing listens", "on ClusterIP:port, the",
                                               "kernel answers RST", "(1.0: accept, then close)")))
IPTABLES = Drawer(_iptables, Hop("filter KUBE-SERVICES", ('"… has no endpoints"', "-j REJECT",
                                                          "(icmp port unreachable)")))
IPVS = Drawer(_ipvs, Hop("IPVS virtual server", ("no real server:", "nowhere to send it",
                                                 "the connection fails")))
NFTABLES = Drawer(_nftables, Hop("no-endpoint-services", ("map ip . proto . port", "goto reject-chain",
                                                          "reject")))
BPF = Drawer(_bpf, Hop("cgroup/connect4 hook", ("service has no backend", "connect() fails with",
                                                "ECONNREFUSED")))


def _text(x: int, y: int, s: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<text x="{x}" y="{y}"{c}>{escape(s)}</text>'


def _box(x: int, y: int, hop: Hop) -> list[str]:
    out = [f'<g class="hop"><rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6"/>',
           _text(x + 8, y + 18, hop.title, "title")]
    out += [_text(x + 8, y + 36 + i * LINE, line) for i, line in enumerate(hop.lines[:4])]
    return out + ["</g>"]


def _arrow(x1: int, y1: int, x2: int, y2: int, cls: str = "fwd") -> str:
    return f'<line class="{cls}" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" marker-end="url(#arrow)"/>'


def render(path: Path, mode: str) -> str:
    """The SVG (a standalone <svg> element) of `path`, marked with the name of its `mode`."""
    n = len(path.hops)
    bx = PAD + SLOTS * (BOX_W + GAP) + GAP  # where the backends column starts
    step = (SLOTS * (BOX_W + GAP) - BOX_W) // max(1, n - 1) if n > 1 else 0  # between hop boxes
    rows = max(1, len(path.backends))
    height = max(BOX_H, rows * 40) + 2 * PAD + 3 * LINE + 10
    width = bx + BOX_W + 40 + PAD
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="path" data-mode="{escape(mode)}" '
           f'viewBox="0 0 {width} {height}" width="{width}" height="{height}">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>']
    for i, hop in enumerate(path.hops):
        x = PAD + i * step
        out += _box(x, PAD, hop)
        if i:
            out.append(_arrow(x - step + BOX_W, PAD + BOX_H // 2, x - 2, PAD + BOX_H // 2))
    last = PAD + (n - 1) * step + BOX_W
    for j, (ep, detail) in enumerate(path.backends):
        y = PAD + j * 40
        out += [f'<g class="backend" data-endpoint="{escape(str(ep))}">',
                f'<rect x="{bx}" y="{y}" width="{BOX_W + 40}" height="34" rx="4"/>',
                _text(bx + 8, y + 14, str(ep), "title"), _text(bx + 8, y + 28, detail), "</g>",
                _arrow(last, PAD + BOX_H // 2, bx - 2, y + 17)]
    if not path.backends:
        out.append(_text(bx, PAD + 20, "no usable endpoint: refused", "none"))
    ry = height - PAD - 2 * LINE
    out += [_arrow(width - PAD, ry - 8, PAD, ry - 8, "reply"),
            _text(PAD, ry + 8, path.reply, "reply"), _text(PAD, ry + 8 + LINE, path.seen_as, "seen")]
    return "\n".join(out + ["</svg>"])
