"""LiveNftables: one ServicePort's part of usproxy's own nftables table, as the kernel holds it.

The web view draws kube-proxy's nftables table (explain/nftables.py) for every Service; next to
it this module shows what usproxy's nftables datapath really installed, read from the kernel
(`nft list table ip usproxy`, explain/live.py) rather than from the agent's memory. usproxy's
layout differs from kube-proxy's (usproxy/offload/nftables: shared group chains and slot maps
instead of chains per Service), so nothing here assumes chain names: a ServicePort's part is found
by what the table itself says:

- its verdict elements: map elements whose comment is the ServicePort's key ("ns/name:port/TCP",
  or that key and a word, "... external"), and the chains that look those maps up;
- its data elements: elements of other maps keyed by one of those frontends (the slot maps that
  hold the endpoints);
- the chains its verdicts reach, followed through `goto`/`jump` and verdict maps.

`excerpt` prints that part in the listing's own words; `path` draws the first packet's way
through it (usproxy.explain.path_drawing). Invariant: pure functions of the listing text; a
listing that holds nothing for the ServicePort yields an empty excerpt and no path.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

from usproxy.explain.path_drawing import Hop, Path
from usproxy.model.service_set import FamilyPort
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import format_hostport

_TARGET = re.compile(r"\b(?:goto|jump) ([\w.-]+)")
_ENDPOINT = re.compile(r"^([0-9a-f.:]+) \. (\d+)$")
_DNAT = re.compile(r"\bdnat (?:ip6? )?to (\S+:\d+)$")
BOX_CHARS = 24  # characters a drawing box (path_drawing.BOX_W) holds on one line


@dataclass
class Block:
    """A set, map or chain of the listing: its kind, name, other lines (type, flags, a chain's
    rules) and, for sets and maps, its elements."""

    kind: str
    name: str
    lines: list[str] = field(default_factory=list)
    elements: list[str] = field(default_factory=list)


def _split_elements(text: str) -> list[str]:
    """"a : b, c : d" -> ["a : b", "c : d"], commas inside quotes kept."""
    out, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [e for e in (*out, cur.strip()) if e]


def parse(listing: str) -> dict[str, Block]:
    """`nft list table` text -> its blocks by name (in the listing's order)."""
    blocks: dict[str, Block] = {}
    cur: Block | None = None
    pending: str | None = None  # an `elements = {` list still open
    for raw in listing.splitlines():
        line = raw.strip()
        if pending is not None:
            pending += " " + line
            if line.endswith("}"):
                assert cur is not None
                cur.elements += _split_elements(pending[:-1])
                pending = None
            continue
        if m := re.match(r"^(chain|map|set) (\S+) \{$", line):
            cur = blocks[m[2]] = Block(m[1], m[2])
        elif line == "}" or cur is None or not line:
            cur = None if line == "}" else cur
        elif line.startswith("elements = {"):
            body = line[len("elements = {"):]
            if body.endswith("}"):
                cur.elements += _split_elements(body[:-1])
            else:
                pending = body
        else:
            cur.lines.append(line)
    return blocks


def _comment_of(element: str) -> str | None:
    m = re.search(r' comment "([^"]*)"', element)
    return m[1] if m else None


def _key_of(element: str) -> str:
    """The element's key: what comes before its comment or its value."""
    return re.split(r' comment "| : ', element, maxsplit=1)[0]


@dataclass(frozen=True, slots=True)
class Part:
    """A ServicePort's part of the table: (map, element) verdicts, (map, element) data, and the
    chains involved in the order they are reached (dispatching chains first)."""

    verdicts: tuple[tuple[str, str], ...]
    data: tuple[tuple[str, str], ...]
    chains: tuple[str, ...]

    @property
    def frontends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_key_of(e) for _, e in self.verdicts))


def part_of(blocks: dict[str, Block], key: str) -> Part:
    """The part of the table that belongs to the ServicePort whose key is `key`."""
    verdicts = [(b.name, e) for b in blocks.values() if b.kind == "map" for e in b.elements
                if (c := _comment_of(e)) is not None and (c == key or c.startswith(key + " "))]
    fronts = {_key_of(e) for _, e in verdicts}
    data = [(b.name, e) for b in blocks.values() if b.kind == "map" for e in b.elements
            if _comment_of(e) is None and _key_of(e) in fronts]
    maps = {m for m, _ in verdicts}
    chains = [b.name for b in blocks.values() if b.kind == "chain"
              and any(f"@{m}" in line for line in b.lines for m in maps)]
    todo = [t for _, e in verdicts for t in _TARGET.findall(e)]
    while todo:
        name = todo.pop(0)
        if name in chains or name not in blocks:
            continue
        chains.append(name)
        todo += [t for line in blocks[name].lines for t in _TARGET.findall(line)]
    return Part(tuple(verdicts), tuple(data), tuple(chains))


def excerpt(listing: str, key: str, title: str = "") -> str:
    """The ServicePort's part in the listing's words, under `title`; "" when the table holds
    nothing for it."""
    blocks = parse(listing)
    part = part_of(blocks, key)
    if not part.verdicts:
        return ""
    out = [f"# {title}"] if title else []
    for name in dict.fromkeys(m for m, _ in (*part.verdicts, *part.data)):
        mine = [e for m, e in (*part.verdicts, *part.data) if m == name]
        out += [f"map {name} {{  # {len(mine)} of its {len(blocks[name].elements)} elements",
                *(f"\t{e}" for e in mine), "}"]
    for name in part.chains:
        out += [f"chain {name} {{", *(f"\t{line}" for line in blocks[name].lines), "}"]
    return "\n".join(out) + "\n"


def _box(title: str, text: str) -> Hop:
    """A drawing box for a chain: its rules wrapped to the box, at most four lines."""
    lines = textwrap.wrap(text, BOX_CHARS) or [""]
    if len(lines) > 4:
        lines = [*lines[:3], lines[3][:BOX_CHARS - 1] + "…"]
    return Hop(title[:BOX_CHARS - 2], tuple(lines))


def _rules(blocks: dict[str, Block], chain: str) -> str:
    return "; ".join(line for line in blocks[chain].lines if not line.startswith("type "))


def path(listing: str, fp: FamilyPort, endpoints: dict[str, Endpoint]) -> Path | None:
    """The first packet's way to `fp`'s ClusterIP through usproxy's table as listed: the chain
    that looks the frontend up, the chains its verdict reaches (a fan-out, such as a numgen
    choice between slot chains, drawn as one box), and the endpoints the data maps hold for the
    frontend (named by `endpoints`, "ip:port" -> Endpoint). None when the table holds no verdict
    for that frontend."""
    blocks = parse(listing)
    part = part_of(blocks, fp.sp.name.key())
    front = f"{fp.cluster_ip} . {fp.proto} . {fp.sp.port}"
    verdict = next((e for _, e in part.verdicts if _key_of(e) == front), None)
    if verdict is None:
        return None
    target = format_hostport(str(fp.cluster_ip), fp.sp.port) + "/" + fp.proto
    vmap = next(m for m, e in part.verdicts if e == verdict)
    lookup = next((c for c in part.chains if any(f"vmap @{vmap}" in x for x in blocks[c].lines)), vmap)
    hooks = [b.name for b in blocks.values() if b.kind == "chain" and any(x.startswith("type ") and " hook " in x
             for x in b.lines) and any(f"jump {lookup}" in x for x in b.lines)]
    hops = [Hop("client", ("SYN to", target)),
            Hop(lookup[:BOX_CHARS - 2], (f"from {hooks[0]}" if hooks else f"looks up @{vmap}",
                                         *textwrap.wrap(f"@{vmap}: {verdict.split(' : ', 1)[-1]}", BOX_CHARS)[:3]))]
    chain = next(iter(_TARGET.findall(verdict)), None)
    while chain in blocks and len(hops) < 4:
        hops.append(_box(chain, _rules(blocks, chain)))
        nxt = list(dict.fromkeys(_TARGET.findall(_rules(blocks, chain))))
        if len(nxt) > 1 and len(hops) < 4:
            hops.append(_box(f"{nxt[0]} … {nxt[-1]}", _rules(blocks, nxt[0])))
            break
        chain = nxt[0] if nxt else None
    backends = []
    for name, e in part.data:  # slot maps: the frontend's endpoints as map values
        m = _ENDPOINT.match(e.split(" : ", 1)[-1]) if _key_of(e) == front else None
        ep = endpoints.get(format_hostport(m[1], int(m[2]))) if m else None
        if ep is not None:
            backends.append((ep, name))
    for chain in part.chains if not backends else ():  # chains of its own: `dnat to ip:port`
        for line in blocks[chain].lines:
            ep = endpoints.get(m[1]) if (m := _DNAT.search(line)) else None
            if ep is not None and all(ep != b for b, _ in backends):
                backends.append((ep, chain))
    return Path(tuple(hops), tuple(backends),
                "reply: conntrack un-DNATs backend → ClusterIP:port (drawn from the kernel's table)",
                "backend sees: the client (the node if marked for masquerade)")


def live_part(fps: list[FamilyPort], listings: dict[int, str],
              endpoints: dict[str, Endpoint]) -> tuple[str, list[str]]:
    """(excerpt, SVG drawings) of `fps` in usproxy's tables: `listings` by IP family (the
    `nft list table` text of each family read), `endpoints` "ip:port" -> Endpoint. A family
    whose table holds nothing for a ServicePort adds a line saying so."""
    from usproxy.explain import path_drawing

    texts, svgs = [], []
    for fp in fps:
        listing = listings.get(fp.family)
        key = fp.sp.name.key()
        text = excerpt(listing, key, f"{key} in nft list table {'ip' if fp.family == 4 else 'ip6'} usproxy, "
                                     "as the kernel holds it now") if listing else ""
        texts.append(text or f"# {key}: nothing in usproxy's IPv{fp.family} nftables table "
                             "(not offloaded to nftables now, or no table)\n")
        drawn = path(listing, fp, endpoints) if listing else None
        if drawn is not None:
            svgs.append(path_drawing.render(drawn, "nftables-live"))
    return "\n".join(dict.fromkeys(texts)), svgs
