"""FakeNft: an in-memory nftables that applies usproxy's Commands, for unit tests.

It applies a transaction to a copy and swaps it in only if every command succeeds, refusing what
the kernel refuses (deleting a missing element, chain or set; deleting a chain that is still
referenced or not empty; referencing a missing chain, map or set), so ordering mistakes in
generated transactions fail in unit tests. `dump()` renders a stable text (as knftables' fake
Dump()); `trace()` follows a packet through the generated rules to the endpoints it can reach
(as kube-proxy's runPacketFlowTests in pkg/proxy/nftables/helpers_test.go).
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from usproxy.errors import OffloadError
from usproxy.offload.nftables.commands import Command, Rule
from usproxy.offload.nftables.names import Family, nft_family

ENOENT, EEXIST, EBUSY = 2, 17, 16


@dataclass
class FakeTable:
    maps: dict[str, dict[str, tuple[str | None, str | None]]] = field(default_factory=dict)
    sets: dict[str, set[str]] = field(default_factory=dict)
    chains: dict[str, list[Rule]] = field(default_factory=dict)
    hooks: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)  # `numgen inc` state, by chain


@dataclass(frozen=True, slots=True)
class Trace:
    """Where a packet goes: `dnat` to one of `targets` ("ip:port"), `reject`, or `none`
    (no usproxy rule matched: the relay or the local stack gets it). `masq`: targets for which
    the source is masqueraded."""

    verdict: str
    targets: frozenset[str] = frozenset()
    masq: frozenset[str] = frozenset()


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

    def delete_tables(self) -> None:
        self.tables.clear()

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
                    out.append(f"  chain {name}: {rule.text}")
        return "\n".join(out)

    # -- packets
    def trace(self, family: Family, src: str, dst: str, proto: str, dport: int,
              local: Iterable[str] = ()) -> Trace:
        """Follow a new connection src -> dst:dport through nat `services`, then the filter
        `endpoints-check`. `local` lists this node's addresses (for NodePorts)."""
        t = self.tables.get(family)
        if t is None:
            return Trace("none")
        pkt = _Packet(src, dst, proto.lower(), dport, set(local))
        res = _run(t, "services", pkt)
        if res.verdict == "dnat":
            hairpin = f"{src} . {src}" in t.sets.get("hairpin", set())
            masq = {x for x in res.targets if hairpin and x.rsplit(":", 1)[0].strip("[]") == src}
            return Trace("dnat", res.targets, res.masq | frozenset(masq))
        return _run(t, "endpoints-check", _Packet(src, dst, proto.lower(), dport, set(local)))


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
    return {"concat": [_scalar(p) for p in value.split(" . ")]}


def _rule_json(r: Rule) -> list[dict[str, Any]]:
    if r.op == "mark":
        return [{"mangle": {"key": {"meta": {"key": "mark"}}}}]
    if r.op == "goto":
        return [{"goto": {"target": r.args[0]}}]
    if r.op in ("numgen", "numgen-inc"):
        data = [[i, {"goto": {"target": c}}] for i, c in enumerate(r.args)]
        mode = "inc" if r.op == "numgen-inc" else "random"
        return [{"vmap": {"key": {"numgen": {"mode": mode, "mod": len(r.args)}}, "data": {"set": data}}}]
    if r.op == "affinity-check":
        return [{"match": {"op": "==", "right": "@" + r.args[0]}}, {"goto": {"target": r.args[1]}}]
    if r.op == "affinity-update":
        return [{"set": {"op": "update", "elem": {"elem": {"timeout": int(r.args[1])}}, "set": "@" + r.args[0]}}]
    if r.op == "dnat":
        return [{"dnat": {"addr": r.args[0], "port": int(r.args[1])}}]
    return [{"raw": r.text}]


@dataclass
class _Packet:
    src: str
    dst: str
    proto: str
    dport: int
    local: set[str]
    masq: bool = False

    def key(self, kind: str) -> str | None:
        if kind == "ip":
            return f"{self.dst} . {self.proto} . {self.dport}"
        if self.dst in self.local and not ipaddress.ip_address(self.dst).is_loopback:
            return f"{self.proto} . {self.dport}"
        return None


def _run(t: FakeTable, chain: str, pkt: _Packet, depth: int = 0) -> Trace:
    if depth > 16:
        raise AssertionError(f"chain loop at {chain}")
    for rule in t.chains.get(chain, []):
        res = _rule(t, rule, pkt, depth, chain)
        if res is not None:
            return res
    return Trace("none")


def _goto(t: FakeTable, verdict: str | None, pkt: _Packet, depth: int) -> Trace | None:
    if verdict is None:
        return None
    return _run(t, verdict.split()[-1], pkt, depth + 1)


def _rule(t: FakeTable, rule: Rule, pkt: _Packet, depth: int, chain: str) -> Trace | None:
    op, a = rule.op, rule.args
    if op == "vmap":
        key = pkt.key(a[0])
        return _goto(t, t.maps[a[1]].get(key, (None, None))[0], pkt, depth) if key else None
    if op in ("goto", "jump"):
        return _run(t, a[0], pkt, depth + 1)
    if op == "mark":
        pkt.masq = True
        return None
    if op == "numgen-inc":  # the kernel's per-rule counter: each trace takes the next chain
        n = t.counters.get(chain, 0)
        t.counters[chain] = n + 1
        return _run(t, a[n % len(a)], pkt, depth + 1)
    if op == "numgen":
        results = [_run(t, c, copy.copy(pkt), depth + 1) for c in a]
        return Trace("dnat", frozenset().union(*(r.targets for r in results)),
                     frozenset().union(*(r.masq for r in results)))
    if op == "dnat-map":
        key = pkt.key(a[0])
        value = t.maps[a[1]].get(key or "", (None, None))[0]
        if value is None:
            return Trace("none")
        ip, port = value.split(" . ")
        return _dnat(pkt, _hostport(ip, port))
    if op == "affinity-check":
        return _run(t, a[1], pkt, depth + 1) if pkt.src in t.sets[a[0]] else None
    if op == "dnat":
        return _dnat(pkt, _hostport(a[0], a[1]))
    if op == "reject":
        return Trace("reject")
    return None


def _dnat(pkt: _Packet, target: str) -> Trace:
    return Trace("dnat", frozenset({target}), frozenset({target}) if pkt.masq else frozenset())


def _hostport(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


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
            if any(tok == needle or tok.rstrip(",") == needle for tok in r.text.split()):
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
    assert cmd.rule is not None
    if cmd.name not in t.chains:
        raise _fail(cmd, "no such chain", ENOENT)
    toks = cmd.rule.text.replace(",", " ").split()
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
