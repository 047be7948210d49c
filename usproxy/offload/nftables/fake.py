"""FakeNft: an in-memory nftables that applies usproxy's Commands, for unit tests.

It applies a transaction to a copy and swaps it in only if every command succeeds, refusing what
the kernel refuses (deleting a missing element, chain or set; deleting a chain that is still
referenced or not empty; referencing a missing chain, map or set), so ordering mistakes in
generated transactions fail in unit tests. `dump()` renders a stable text (as knftables' fake
Dump()). Chains hold each rule's nft text exactly as the kernel receives it and nothing else:
`listing()` derives read back's JSON from that text, and the tests' packet tracer
(tests/offload/nft_trace.py, as kube-proxy's pkg/proxy/nftables/helpers_test.go) reads it too.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from usproxy.util.errors import OffloadError
from usproxy.offload.nftables.commands import MARK_MASQ, Command
from usproxy.model.types import Family
from usproxy.offload.nftables.names import nft_family

ENOENT, EEXIST, EBUSY = 2, 17, 16


@dataclass
class FakeTable:
    """One family's table: map key -> (value, comment), set keys, chain -> rules, hooked chains."""

    maps: dict[str, dict[str, tuple[str | None, str | None]]] = field(default_factory=dict)
    sets: dict[str, set[str]] = field(default_factory=dict)
    chains: dict[str, list[str]] = field(default_factory=dict)  # rule text, as the kernel got it
    hooks: dict[str, str] = field(default_factory=dict)
    # `numgen inc` state by chain: the kernel keeps a counter per rule, reset when the chain is
    # flushed; the tests' tracer reads and advances it
    counters: dict[str, int] = field(default_factory=dict)


class FakeNft:
    """Tables keyed by family; `transactions` counts successful applies; `fail_next` injects
    a refused transaction."""

    def __init__(self) -> None:
        self.tables: dict[Family, FakeTable] = {}
        self.transactions = 0
        self.fail_next = 0

    def apply(self, commands: Iterable[Command]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise OffloadError("injected transaction failure", EBUSY)
        work = copy.deepcopy(self.tables)
        for cmd in commands:
            _apply_one(work, cmd)
        self.tables = work
        self.transactions += 1

    # -- text
    def dump(self) -> str:
        out = []
        for fam in sorted(self.tables):
            t = self.tables[fam]
            out.append(f"table {nft_family(fam)} usproxy")
            for name in sorted(t.maps):
                for key in sorted(t.maps[name]):
                    value, comment = t.maps[name][key]
                    c = f' "{comment}"' if comment else ""
                    out.append(f"  map {name}: {key}{c} : {value}")
            for name in sorted(t.sets):
                for key in sorted(t.sets[name]):
                    out.append(f"  set {name}: {key}")
            for name in sorted(t.chains):
                if name in t.hooks:
                    continue
                for rule in t.chains[name]:
                    out.append(f"  chain {name}: {rule}")
        return "\n".join(out)


class FakeNftClient:
    """The NftTransport of NftablesDatapath over a FakeNft, listing it as `nft -j` would."""

    def __init__(self, nft: FakeNft | None = None) -> None:
        self.nft = nft or FakeNft()

    async def apply(self, commands: Sequence[Command]) -> None:
        self.nft.apply(commands)

    async def list_set(self, family: str, table: str, name: str) -> str:
        """The fake keeps no element timers: nothing to carry over when a timeout changes."""
        return ""

    async def list_table(self, family: str, table: str) -> list[dict[str, Any]] | None:
        fam: Family = 4 if family == "ip" else 6
        t = self.nft.tables.get(fam)
        return None if t is None else listing(t)

    def probe(self) -> str:
        return "fake"

    def close(self) -> None:
        pass


def listing(t: FakeTable) -> list[dict[str, Any]]:
    """The table as `nft -j list table` shows it, as far as read back looks at it."""
    out: list[dict[str, Any]] = []
    for name, elems in t.maps.items():
        rows = [[_key_json(k, c), _value_json(v)] for k, (v, c) in elems.items()]
        out.append({"map": {"name": name, "elem": rows}})
    for name, keys in t.sets.items():
        out.append({"set": {"name": name, "elem": [_key_json(k, None) for k in keys]}})
    for name, rules in t.chains.items():
        out.append({"chain": {"name": name}})
        out += [{"rule": {"chain": name, "expr": _rule_json(r)}} for r in rules]
    return out


def _scalar(text: str) -> Any:
    return int(text) if text.isdigit() else text


def _key_json(key: str, comment: str | None) -> Any:
    parts = [_scalar(p) for p in key.split(" . ")]
    val: Any = {"concat": parts} if len(parts) > 1 else parts[0]
    return {"elem": {"val": val, "comment": comment}} if comment else val


def _value_json(value: str | None) -> Any:
    if value is None:
        return None
    if value.startswith("goto "):
        return {"goto": {"target": value.split()[1]}}
    if value == "drop":
        return {"drop": None}
    return {"concat": [_scalar(p) for p in value.split(" . ")]}


_NUMGEN = re.compile(r"^numgen (random|inc) mod (\d+) vmap \{ (.*) \}$")
_CHECK = re.compile(r"^ip6? saddr @(\S+) goto (\S+)$")
_UPDATE = re.compile(r"^update @(\S+) \{ ip6? saddr timeout (\d+)s \}$")
_DNAT = re.compile(r"dnat ip6? to (?:\[([0-9a-fA-F:.]+)\]|([0-9.]+)):(\d+)$")
_GOTO = re.compile(r"^goto (\S+)$")
_DNAT_PICK = re.compile(r"dnat ip6? to numgen random mod \d+ map \{ (.*) \}$")
_MATCHED = re.compile(r"^(?P<match>(?:fib saddr type local|meta iiftype != loopback|ip6? saddr (?:!= )?\S+/\d+|iifname (?:!= )?\"[^\"]*\"))"
                      r" (?P<rest>.+)$")
_FIREWALL = re.compile(r"^ip6? saddr != \{ (.*) \} drop$")


def _rule_json(rule: str) -> list[dict[str, Any]]:
    """The statements of one rule's text as `nft -j` lists them, as far as read back reads them
    (the rest as "raw")."""
    if rule == MARK_MASQ:
        return [{"mangle": {"key": {"meta": {"key": "mark"}}}}]
    if rule == "drop":
        return [{"drop": None}]
    if m := _MATCHED.match(rule):  # a detector or `fib saddr` match before a mark or a goto
        return [{"match": {"op": "==", "raw": m.group("match")}}, *_rule_json(m.group("rest"))]
    if m := _DNAT_PICK.search(rule):
        pairs = [v.split(" : ")[1].split(" . ") for v in m.group(1).split(", ")]
        data = [[i, {"concat": [ip, int(port)]}] for i, (ip, port) in enumerate(pairs)]
        return [{"dnat": {"addr": {"map": {"key": {"numgen": {"mode": "random"}}, "data": {"set": data}}}}}]
    if m := _GOTO.match(rule):
        return [{"goto": {"target": m.group(1)}}]
    if m := _NUMGEN.match(rule):
        chains = [v.split(" : goto ")[1] for v in m.group(3).split(", ")]
        data = [[i, {"goto": {"target": c}}] for i, c in enumerate(chains)]
        return [{"vmap": {"key": {"numgen": {"mode": m.group(1), "mod": int(m.group(2))}}, "data": {"set": data}}}]
    if m := _CHECK.match(rule):
        return [{"match": {"op": "==", "right": "@" + m.group(1)}}, {"goto": {"target": m.group(2)}}]
    if m := _UPDATE.match(rule):
        return [{"set": {"op": "update", "elem": {"elem": {"timeout": int(m.group(2))}}, "set": "@" + m.group(1)}}]
    if m := _FIREWALL.match(rule):
        return [{"match": {"op": "!=", "left": {"payload": {"field": "saddr"}},
                           "right": {"set": [_source_json(x) for x in m.group(1).split(", ")]}}}, {"drop": None}]
    if m := _DNAT.search(rule):
        return [{"dnat": {"addr": m.group(1) or m.group(2), "port": int(m.group(3))}}]
    return [{"raw": rule}]


def _source_json(text: str) -> Any:
    """A set element as `nft -j` lists it: an address, or a prefix object."""
    if "/" not in text:
        return text
    addr, length = text.split("/")
    return {"prefix": {"addr": addr, "len": int(length)}}


# -- applying commands ---------------------------------------------------------------------------
def _fail(cmd: Command, why: str, errno: int) -> OffloadError:
    return OffloadError(f"{cmd.nft()[:120]}: {why}", errno)


def _apply_one(tables: dict[Family, FakeTable], cmd: Command) -> None:
    if cmd.obj == "table":
        if cmd.verb == "add":
            tables.setdefault(cmd.family, FakeTable())
        elif tables.pop(cmd.family, None) is None:
            raise _fail(cmd, "no such table", ENOENT)
        return
    t = tables.get(cmd.family)
    if t is None:
        raise _fail(cmd, "no such table", ENOENT)
    handler = {"map": _map_or_set, "set": _map_or_set, "chain": _chain, "rule": _rule_cmd,
               "element": _element}[cmd.obj]
    handler(t, cmd)


def _map_or_set(t: FakeTable, cmd: Command) -> None:
    if cmd.verb == "add":
        if cmd.obj == "map":
            t.maps.setdefault(cmd.name, {})
        else:
            t.sets.setdefault(cmd.name, set())
        return
    store: dict[str, object] = t.maps if cmd.obj == "map" else t.sets  # type: ignore[assignment]
    if cmd.name not in store:
        raise _fail(cmd, "no such set", ENOENT)
    if _referenced(t, "@" + cmd.name):
        raise _fail(cmd, "set in use", EBUSY)
    del store[cmd.name]


def _referenced(t: FakeTable, needle: str) -> bool:
    for rules in t.chains.values():
        for r in rules:
            if any(tok == needle or tok.rstrip(",") == needle for tok in r.split()):
                return True
    for m in t.maps.values():
        if any(v == needle for v, _ in m.values()):
            return True
    return False


def _chain(t: FakeTable, cmd: Command) -> None:
    if cmd.verb == "add":
        t.chains.setdefault(cmd.name, [])
        if cmd.spec:
            t.hooks[cmd.name] = cmd.spec
        return
    if cmd.name not in t.chains:
        raise _fail(cmd, "no such chain", ENOENT)
    if cmd.verb == "flush":
        t.chains[cmd.name] = []
        t.counters.pop(cmd.name, None)  # new rules, new numgen counters
        return
    if t.chains[cmd.name] or _referenced(t, cmd.name) or _referenced(t, f"goto {cmd.name}"):
        raise _fail(cmd, "chain in use", EBUSY)
    del t.chains[cmd.name]
    t.hooks.pop(cmd.name, None)


def _rule_cmd(t: FakeTable, cmd: Command) -> None:
    if cmd.name not in t.chains:
        raise _fail(cmd, "no such chain", ENOENT)
    toks = cmd.rule.replace(",", " ").split()
    for i, tok in enumerate(toks):
        if tok.startswith("@") and tok[1:] not in t.maps and tok[1:] not in t.sets:
            raise _fail(cmd, f"no such set {tok}", ENOENT)
        if tok in ("goto", "jump") and toks[i + 1] not in t.chains:
            raise _fail(cmd, f"no such chain {toks[i + 1]}", ENOENT)
    t.chains[cmd.name].append(cmd.rule)


def _element(t: FakeTable, cmd: Command) -> None:
    is_map = cmd.name in t.maps
    if not is_map and cmd.name not in t.sets:
        raise _fail(cmd, "no such set", ENOENT)
    for e in cmd.elems:
        if cmd.verb == "delete":
            store = t.maps[cmd.name] if is_map else t.sets[cmd.name]
            if e.key not in store:
                raise _fail(cmd, f"no such element {e.key}", ENOENT)
            if is_map:
                del t.maps[cmd.name][e.key]
            else:
                t.sets[cmd.name].discard(e.key)
            continue
        if is_map:
            _add_map_elem(t, cmd, e.key, e.value, e.comment)
        else:
            t.sets[cmd.name].add(e.key)


def _add_map_elem(t: FakeTable, cmd: Command, key: str, value: str | None, comment: str | None) -> None:
    m = t.maps[cmd.name]
    if key in m and m[key][0] != value:
        raise _fail(cmd, f"element {key} exists", EEXIST)
    if value and value.startswith("goto ") and value.split()[1] not in t.chains:
        raise _fail(cmd, f"no such chain {value}", ENOENT)
    m[key] = (value, comment)
