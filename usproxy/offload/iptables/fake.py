"""FakeIptablesClient: the iptables tools of the IptablesClient interface, in memory, for unit
tests without root.

It keeps tables per (backend, family) and applies restore input with iptables' own rules, so
tests catch what the kernel would refuse: a chain line creates or flushes a user chain, `-A`,
`-I CHAIN N`, `-D CHAIN spec`, `-F`, `-X` (a chain in use or not empty cannot go), a jump to a
chain that does not exist fails, and a table changes only at its COMMIT, all or nothing. `save`
prints the tables as iptables-legacy-save does (built-in chains first, then user chains by name),
but rules as they were written, not normalised. `fail_next` makes the next restore fail;
`restores` records every input. `unshare --net CMD` runs CMD on a copy that is thrown away.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from usproxy.util.errors import OffloadError

T = TypeVar("T")
BUILTIN = {"filter": ("INPUT", "FORWARD", "OUTPUT"), "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
           "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")}
TARGETS = {"ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "SNAT", "MASQUERADE", "MARK", "LOG", "CONNMARK"}


@dataclass
class _Table:
    chains: dict[str, list[str]] = field(default_factory=dict)  # chain -> rule specs

    def refs(self, chain: str) -> int:
        return sum(_target(spec) == chain for rules in self.chains.values() for spec in rules)


class FakeIptablesClient:
    """In-memory iptables for every backend and family."""

    def __init__(self, backends: Sequence[str] = ("nft", "legacy"), *, v6: bool = True) -> None:
        self.tables: dict[tuple[str, int], dict[str, _Table]] = {}
        self.backends = tuple(backends)  # those whose tools work here
        self.v6 = v6
        self.restores: list[tuple[str, str]] = []  # (command, input)
        self.fail_next = 0
        self.sysctls: dict[str, str] = {"net.netfilter.nf_conntrack_tcp_be_liberal": "0"}

    def family_tables(self, backend: str, family: int) -> dict[str, _Table]:
        return self.tables.setdefault((backend, family), {})

    # -- IptablesClient ---------------------------------------------------------------------------
    async def run(self, argv: Sequence[str], stdin: str | None = None) -> str:
        return self._run(list(argv), stdin)

    def run_sync(self, argv: Sequence[str], stdin: str | None = None) -> str | None:
        try:
            return self._run(list(argv), stdin)
        except OffloadError:
            return None

    async def ensure_nfacct(self) -> str | None:
        return None

    async def sysctl(self, path: str, value: str | None = None) -> str | None:
        if value is not None:
            self.sysctls[path] = value
        return self.sysctls.get(path)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    def close(self) -> None:
        pass

    # -- the tools ----------------------------------------------------------------------------------
    def _run(self, argv: list[str], stdin: str | None) -> str:
        if argv[:2] == ["unshare", "--net"]:  # a namespace of its own: checked, nothing kept
            if argv[2:] == ["true"]:
                return ""
            saved, restores = copy.deepcopy(self.tables), list(self.restores)
            try:
                return self._run(argv[2:], stdin)
            finally:
                self.tables, self.restores = saved, restores
        tool = argv[0]
        family = 6 if tool.startswith("ip6") else 4
        backend = tool.split("-")[1]
        if backend not in self.backends or (family == 6 and not self.v6):
            raise OffloadError(f"{tool}: not supported here")
        if "--version" in argv:
            return f"{tool.split('-')[0]} v1.8.9 ({'nf_tables' if backend == 'nft' else 'legacy'})\n"
        if tool.endswith("-save"):
            table = argv[argv.index("-t") + 1] if "-t" in argv else None
            return self.save(backend, family, table)
        if tool.endswith("-restore"):
            self.restores.append((tool, stdin or ""))
            self.restore(backend, family, stdin or "")
            return ""
        raise OffloadError(f"{tool}: unexpected command {argv}")

    def save(self, backend: str, family: int, only: str | None = None) -> str:
        out = []
        for name, table in self.family_tables(backend, family).items():
            if only is not None and name != only:
                continue
            builtin = BUILTIN[name]
            users = sorted(c for c in table.chains if c not in builtin)
            out.append(f"*{name}")
            out += [f":{c} ACCEPT [0:0]" for c in builtin] + [f":{c} - [0:0]" for c in users]
            out += [f"-A {c} {spec}" for c in (*builtin, *users) for spec in table.chains.get(c, [])]
            out.append("COMMIT")
        return "\n".join(out) + "\n" if out else ""

    def restore(self, backend: str, family: int, text: str) -> None:
        """Apply restore input; each table's changes land at its COMMIT, or none on error."""
        if self.fail_next:
            self.fail_next -= 1
            raise OffloadError("iptables-restore: injected failure")
        tables = self.family_tables(backend, family)
        name, work = "", _Table()
        for n, line in enumerate(text.splitlines(), start=1):
            try:
                if line.startswith("*"):
                    name = line[1:]
                    base = tables.get(name) or _Table({c: [] for c in BUILTIN[name]})
                    work = copy.deepcopy(base)
                elif line == "COMMIT":
                    tables[name] = work
                elif line and not line.startswith("#"):
                    _apply(work, name, line)
            except (KeyError, ValueError, IndexError) as err:
                raise OffloadError(f"iptables-restore: line {n} failed: {err}") from None


def _target(spec: str) -> str | None:
    tokens = spec.split()
    for flag in ("-j", "-g"):
        if flag in tokens:
            return tokens[tokens.index(flag) + 1]
    return None


def _apply(t: _Table, table: str, line: str) -> None:
    verb, _, rest = line.partition(" ")
    if verb.startswith(":"):
        chain = verb[1:]
        if chain not in BUILTIN[table]:
            t.chains[chain] = []
        return
    chain, _, spec = rest.partition(" ")
    if verb in ("-A", "-I", "-D", "-F", "-X") and chain not in t.chains:
        raise KeyError(f"no chain {chain}")
    if verb in ("-A", "-I"):
        if verb == "-I":
            pos, _, spec = spec.partition(" ")
        target = _target(spec)
        if target is not None and target not in TARGETS and target not in t.chains:
            raise KeyError(f"no chain/target/match by the name {target}")
        if verb == "-A":
            t.chains[chain].append(spec)
        else:
            t.chains[chain].insert(int(pos) - 1, spec)
    elif verb == "-D":
        t.chains[chain].remove(spec)
    elif verb == "-F":
        t.chains[chain].clear()
    elif verb == "-X":
        if t.chains[chain] or t.refs(chain) or chain in BUILTIN[table]:
            raise ValueError(f"chain {chain} busy")
        del t.chains[chain]
    else:
        raise ValueError(f"unknown command {verb}")
