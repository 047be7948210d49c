"""Read back: rebuild a TableState from `nft -j list table` output after an agent restart.

kube-proxy's nftables mode rebuilds its whole table on the first sync; usproxy must not (field
case C20: offloaded traffic must not notice a restart), so it reads the table back and the first
sync applies only the difference. Verdict elements carry the ServicePortName (and " external" for
external frontends) as their comment; slot maps give each frontend's endpoints by slot; affinity
ServicePorts are read from their endpoint chains' `dnat` and `update ... timeout` statements, and
loadBalancerSourceRanges from `firewall-ips` (comment: the ServicePortName) and the `fw-<hash>`
chain's `saddr != { ... }` set.
Anything that cannot be attributed is left to the next full sync, which replaces what differs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from usproxy.offload.nftables.commands import NODEPORT_IPS, SERVICE_FRONTENDS
from usproxy.offload.nftables.names import (
    FIREWALL_MAP,
    GROUP_CHAIN,
    Kind,
    firewall_chain,
    parse_comment,
    slot_chain,
    slot_map,
    verdict_map,
)
from usproxy.offload.nftables.rules import Backend, Frontend, PortRules, Target, frontend_order, norm_ip, source_text
from usproxy.offload.nftables.transaction import TableState
from usproxy.model.types import Family, Scope, ServicePortName

_VERDICT_MAPS: dict[str, Kind] = {"service-ips": "ip", "no-endpoint-services": "ip",
                                  "service-nodeports": "np", "no-endpoint-nodeports": "np"}


@dataclass
class _Listing:
    maps: dict[str, list[Any]] = field(default_factory=dict)
    sets: dict[str, list[Any]] = field(default_factory=dict)
    chains: set[str] = field(default_factory=set)
    slots: dict[str, dict[str, Target]] = field(default_factory=dict)
    rules: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)


@dataclass
class _Seen:
    """Per ServicePort, the frontends found with their verdict target."""

    frontends: list[tuple[Frontend, str]] = field(default_factory=list)


def read_table(family: Family, items: list[dict[str, Any]] | None) -> TableState:
    """The TableState that `items` (the JSON listing of one family's table) describes."""
    state = TableState(family)
    if not items:
        return state
    lst = _index(items)
    state.slots = {k: _slot_count(lst, k) for k in ("ip", "np")}
    state.groups = {c for c in lst.chains if GROUP_CHAIN.match(c)}
    seen = _verdicts(lst)
    for spn, s in seen.items():
        rules = _port_rules(family, spn, s, lst)
        if rules is not None:
            state.rules[spn] = rules
    hairpin = _hairpin_ips(lst)
    firewalls = _firewalls(lst)
    for spn, rules in state.rules.items():
        rules = state.rules[spn] = _with_firewall(_with_hairpin(rules, hairpin), firewalls.get(spn, []), lst)
        for ip in rules.hairpin:
            state.hairpin[ip] += 1
    state.nodeport_ips = frozenset(norm_ip(str(_concat(e)[0])) for e in lst.sets.get(NODEPORT_IPS, []))
    state.orphans = _orphans(lst, state)
    state.frontends_missing = frozenset(_frontends_missing(lst))
    return state


def _frontends_missing(lst: _Listing) -> set[str]:
    """Keys of `service-ips` that SERVICE_FRONTENDS lacks (its extra keys are orphans)."""
    have = {_key_text("ip", _concat(e)) for e in lst.sets.get(SERVICE_FRONTENDS, [])}
    return {_key_text("ip", _concat(k)) for k, _ in lst.maps.get("service-ips", [])} - have


def _key_text(kind: Kind, parts: list[Any]) -> str:
    """A map key as Frontend.key() writes it (addresses normalised)."""
    text = [str(p) for p in parts]
    if kind == "ip" and text:
        try:
            text[0] = norm_ip(text[0])
        except ValueError:
            pass
    return " . ".join(text)


def _orphans(lst: _Listing, state: TableState) -> dict[str, set[str]]:
    """Elements no ServicePort read back accounts for: verdicts whose comment does not name one
    (an older version's, a name cut at 127 bytes) or whose chain is gone, slot elements of no
    frontend, hairpin pairs of no endpoint. The next transaction deletes them, so what read back
    cannot attribute never keeps DNATing, nor makes the re-added ServicePort's elements clash."""
    owned: set[tuple[str, str]] = {("hairpin", f"{ip} . {ip}") for ip in state.hairpin}
    for rules in state.rules.values():
        for fe in rules.frontends:
            be = rules.backend(fe.scope)
            owned.add((verdict_map(fe.kind, not be.serves()), fe.key()))
            if not be.affinity:
                owned.update((slot_map(fe.kind, i), fe.key()) for i in range(len(be.targets)))
        owned.update((FIREWALL_MAP, key) for key in rules.fw_keys)
    present: set[tuple[str, str]] = {(FIREWALL_MAP, _key_text("ip", _concat(k))) for k, _ in lst.maps.get(FIREWALL_MAP, [])}
    for name, kind in _VERDICT_MAPS.items():
        present.update((name, _key_text(kind, _concat(k))) for k, _ in lst.maps.get(name, []))
    present.update((name, key) for name, index in lst.slots.items() for key in index)
    owned.update((SERVICE_FRONTENDS, key) for name, key in list(owned) if name == "service-ips")
    present.update((SERVICE_FRONTENDS, _key_text("ip", _concat(e))) for e in lst.sets.get(SERVICE_FRONTENDS, []))
    present.update(("hairpin", " . ".join(_key_text("ip", [p]) for p in _concat(e))) for e in lst.sets.get("hairpin", []))
    out: dict[str, set[str]] = {}
    for name, key in present - owned:
        out.setdefault(name, set()).add(key)
    return out


def _firewalls(lst: _Listing) -> dict[ServicePortName, list[tuple[str, str]]]:
    """`firewall-ips` elements by the ServicePort their comment names: (key, chain)."""
    out: dict[ServicePortName, list[tuple[str, str]]] = {}
    for key, value in lst.maps.get(FIREWALL_MAP, []):
        comment = key.get("elem", {}).get("comment") if isinstance(key, dict) else None
        target = (value.get("goto") or {}).get("target") if isinstance(value, dict) else None
        spn = parse_comment(comment)[0] if comment else None
        if spn is not None and target is not None:
            out.setdefault(spn, []).append((_key_text("ip", _concat(key)), target))
    return out


def _with_firewall(rules: PortRules, elems: list[tuple[str, str]], lst: _Listing) -> PortRules:
    """The ServicePort's guarded LB frontends and allowed sources as the kernel holds them: its
    `firewall-ips` elements that go to its own firewall chain, and that chain's `saddr !=` set.
    Anything else is left out (orphans, or rewritten by the next diff)."""
    chain = firewall_chain(rules.spn)
    keys = tuple(sorted(k for k, target in elems if target == chain))
    sources = _fw_sources(lst.rules.get(chain, []))
    if not keys or not sources:
        return rules._replace(fw_keys=keys) if keys else rules
    return rules._replace(fw_sources=sources, fw_keys=keys)


def _fw_sources(rules: list[list[dict[str, Any]]]) -> tuple[str, ...]:
    """The sources of a firewall chain's `ip saddr != { ... } drop` (nft lists a one-element set
    as its element, a host route as a bare address)."""
    for expr in rules:
        for stmt in expr:
            match = stmt.get("match") if isinstance(stmt, dict) else None
            if isinstance(match, dict) and match.get("op") == "!=":
                right = match.get("right")
                items = right["set"] if isinstance(right, dict) and "set" in right else [right]
                return tuple(_source(i) for i in items)
    return ()


def _source(item: Any) -> str:
    if isinstance(item, dict) and "prefix" in item:
        net = ipaddress.ip_network(f"{item['prefix']['addr']}/{item['prefix']['len']}", strict=False)
    else:
        net = ipaddress.ip_network(str(item))
    return source_text(net)


def _hairpin_ips(lst: _Listing) -> set[str]:
    out = set()
    for elem in lst.sets.get("hairpin", []):
        parts = _concat(elem)
        if len(parts) == 2 and parts[0] == parts[1]:
            out.add(norm_ip(str(parts[0])))
    return out


def _with_hairpin(rules: PortRules, hairpin: set[str]) -> PortRules:
    """The ServicePort's hairpin addresses as far as the kernel shows them: its targets that are
    in the shared hairpin set (a guess per address; the next diff corrects the counts only)."""
    return rules._replace(hairpin=frozenset(t.ip for t in rules.targets() if t.ip in hairpin))


def _index(items: list[dict[str, Any]]) -> _Listing:
    lst = _Listing()
    for it in items:
        if "map" in it:
            lst.maps[it["map"]["name"]] = it["map"].get("elem", [])
            if it["map"]["name"].startswith(("slot-", "np-slot-")):
                kind: Kind = "np" if it["map"]["name"].startswith("np-") else "ip"
                lst.slots[it["map"]["name"]] = _slot_index(kind, lst.maps[it["map"]["name"]])
        elif "set" in it:
            lst.sets[it["set"]["name"]] = it["set"].get("elem", [])
        elif "chain" in it:
            lst.chains.add(it["chain"]["name"])
        elif "rule" in it:
            lst.rules.setdefault(it["rule"]["chain"], []).append(it["rule"].get("expr", []))
    return lst


def _slot_count(lst: _Listing, kind: Kind) -> int:
    n = 0
    while slot_map(kind, n) in lst.maps and slot_chain(kind, n) in lst.chains:
        n += 1
    return n


def _verdicts(lst: _Listing) -> dict[ServicePortName, _Seen]:
    seen: dict[ServicePortName, _Seen] = {}
    for name, kind in _VERDICT_MAPS.items():
        for key, value in lst.maps.get(name, []):
            comment = key.get("elem", {}).get("comment") if isinstance(key, dict) else None
            target = (value.get("goto") or {}).get("target") if isinstance(value, dict) else None
            if isinstance(value, dict) and "drop" in value:
                target = "drop"
            if comment is None or target is None:
                continue
            spn, scope = parse_comment(comment)
            fe = _frontend(kind, _concat(key), scope)
            if spn is not None and fe is not None:
                seen.setdefault(spn, _Seen()).frontends.append((fe, target))
    return seen


def _concat(key: Any) -> list[Any]:
    val = key.get("elem", {}).get("val", key) if isinstance(key, dict) else key
    if isinstance(val, dict) and "concat" in val:
        return list(val["concat"])
    return [val]


def _frontend(kind: Kind, parts: list[Any], scope: Scope) -> Frontend | None:
    try:
        if kind == "ip":
            return Frontend(norm_ip(str(parts[0])), str(parts[1]), int(parts[2]), scope)
        return Frontend(None, str(parts[0]), int(parts[1]), "external")
    except (ValueError, IndexError):
        return None


def _slot_targets(lst: _Listing, fe: Frontend, n: int) -> tuple[Target, ...]:
    """The frontend's endpoints by slot, up to the first missing one (callers refuse a short
    list: the ServicePort is then not adopted, its elements are orphans, and it is rebuilt)."""
    out = []
    for i in range(n):
        value = lst.slots.get(slot_map(fe.kind, i), {}).get(fe.key())
        if value is None:
            break
        out.append(value)
    return tuple(out)


def _slot_index(kind: Kind, elems: list[Any]) -> dict[str, Target]:
    """A slot map's elements by key, the key written as Frontend.key() writes it."""
    out = {}
    for key, value in elems:
        v = _concat(value)
        out[_key_text(kind, _concat(key))] = Target(norm_ip(str(v[0])), int(v[1]))
    return out


def _port_rules(family: Family, spn: ServicePortName, seen: _Seen, lst: _Listing) -> PortRules | None:
    backends: dict[Scope, Backend] = {}
    for fe, target in seen.frontends:
        if fe.scope in backends:
            continue
        be = _backend(fe, target, lst)
        if be is None:
            return None
        backends[fe.scope] = be
    frontends = tuple(sorted((fe for fe, _ in seen.frontends), key=frontend_order))
    return PortRules(spn, family, frontends, backends.get("cluster", Backend()), backends.get("external", Backend()))


def _backend(fe: Frontend, target: str, lst: _Listing) -> Backend | None:
    if target == "reject-chain":
        return Backend()
    if target == "drop":
        return Backend(drop=True)
    m = GROUP_CHAIN.match(target)
    if m:  # a slot missing (flushed or deleted behind our back): not adopted, rebuilt whole
        n = int(m.group(3))
        targets = _slot_targets(lst, fe, n)
        return Backend(targets, bool(m.group(2)), nonlocal_only=m.group(2) == "x") if len(targets) == n else None
    if target.startswith("aff-"):
        return _affinity_backend(target, lst)
    if target.startswith("rr-"):
        return _rr_backend(target, fe, lst)
    if target.startswith("xl-"):
        return _short_circuit_backend(target, fe, lst)
    return None


def _short_circuit_backend(chain: str, fe: Frontend, lst: _Listing) -> Backend | None:
    """An externalTrafficPolicy Local chain: matched rules go to the DNAT chain over every
    endpoint; the last, unmatched one to the local verdict (a group chain, ..., or `drop`). The
    hairpin's rule (matched, to the local verdict) comes before the node's: the last matched
    goto is the DNAT chain's."""
    local, pick = None, None
    for expr in lst.rules.get(chain, []):
        matched = any("match" in s for s in expr)
        for stmt in expr:
            if "goto" in stmt:
                if matched:
                    pick = stmt["goto"]["target"]
                else:
                    local = stmt["goto"]["target"]
            elif "drop" in stmt and not matched:
                local = "drop"
    if local is None or pick is None:
        return None
    be = _backend(fe, local, lst)
    short = _pick_targets(lst.rules.get(pick, []))
    return be._replace(short=short) if be is not None and short else None


def _pick_targets(rules: list[list[dict[str, Any]]]) -> tuple[Target, ...]:
    """The targets of `dnat to numgen random mod N map { i : addr . port, ... }`, by i."""
    for expr in rules:
        for stmt in expr:
            data = stmt.get("dnat", {}).get("addr", {}).get("map", {}).get("data", {}) if "dnat" in stmt else {}
            if isinstance(data, dict) and "set" in data:
                pairs = sorted((int(i), v["concat"]) for i, v in data["set"])
                return tuple(Target(norm_ip(str(v[0])), int(v[1])) for _, v in pairs)
    return ()


def _rr_backend(chain: str, fe: Frontend, lst: _Listing) -> Backend | None:
    """A round-robin chain: optional masquerade mark, then `numgen inc` over N slot chains (or a
    goto the one slot chain)."""
    masq, nonlocal_only, n = False, False, 0
    for expr in lst.rules.get(chain, []):
        for stmt in expr:
            if "mangle" in stmt:
                masq, nonlocal_only = True, any("match" in s for s in expr)
            elif "vmap" in stmt and "numgen" in stmt["vmap"].get("key", {}):
                n = len(stmt["vmap"]["data"]["set"])
            elif "goto" in stmt:
                n = 1
    targets = _slot_targets(lst, fe, n)
    return Backend(targets, masq, 0, True, nonlocal_only) if targets and len(targets) == n else None


def _affinity_backend(chain: str, lst: _Listing) -> Backend | None:
    masq, nonlocal_only, order, rr = False, False, [], False
    for expr in lst.rules.get(chain, []):
        for stmt in expr:
            if "mangle" in stmt:
                masq, nonlocal_only = True, any("match" in s for s in expr)
            elif "vmap" in stmt and "numgen" in stmt["vmap"].get("key", {}):
                order = [v["goto"]["target"] for _, v in stmt["vmap"]["data"]["set"]]
                rr = stmt["vmap"]["key"]["numgen"].get("mode") == "inc"
            elif "goto" in stmt and not any("match" in s for s in expr):
                order = [stmt["goto"]["target"]]
    targets, timeout = [], 0
    for ep_chain in order:
        t, timeout = _endpoint_chain(lst.rules.get(ep_chain, []))
        if t is None:
            return None
        targets.append(t)
    return Backend(tuple(targets), masq, timeout, rr, nonlocal_only) if targets else None


def _endpoint_chain(rules: list[list[dict[str, Any]]]) -> tuple[Target | None, int]:
    target, timeout = None, 0
    for expr in rules:
        for stmt in expr:
            if "set" in stmt and isinstance(stmt["set"], Mapping) and stmt["set"].get("op") == "update":
                timeout = int(stmt["set"]["elem"].get("elem", {}).get("timeout", 0))
            elif "dnat" in stmt and "addr" in stmt["dnat"]:
                target = Target(norm_ip(str(stmt["dnat"]["addr"])), int(stmt["dnat"]["port"]))
    return target, timeout
