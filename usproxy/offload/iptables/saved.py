"""SavedTables: iptables-save text as tables, chains and rules, for read back and cleanup.

iptables-save prints every table of one family as `*table`, the chain lines (`:NAME POLICY
[packets:bytes]`, POLICY "-" for a user chain), the rules (`-A CHAIN spec`) and COMMIT. Both
backends print a rule in the same normalised form (`-d 10.96.0.1/32 -p tcp -m comment --comment
"..." -m tcp --dport 80 -j X`), which differs from what kube-proxy writes, so rules are read by
their parts (target, comment, protocol, DNAT destination), never compared as text with the
generator's. Splitting a spec with shlex costs some 20 us: the parts are found with regular
expressions, which is what makes reading back 100,000 rules affordable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TARGET = re.compile(r"(?:^| )-[jg] (\S+)")
_COMMENT = re.compile(r'--comment ("(?:[^"\\]|\\.)*"|\S+)')
_PROTO = re.compile(r"(?:^| )-p (\S+)")
_TO = re.compile(r"--to-destination (\S+)")


@dataclass(frozen=True, slots=True)
class SavedRule:
    """One `-A CHAIN spec` line."""

    chain: str
    spec: str

    @property
    def target(self) -> str | None:
        m = _TARGET.search(self.spec)
        return m.group(1) if m else None

    @property
    def comment(self) -> str | None:
        m = _COMMENT.search(self.spec)
        if m is None:
            return None
        text = m.group(1)
        return text[1:-1].replace('\\"', '"') if text.startswith('"') else text

    @property
    def protocol(self) -> str | None:
        m = _PROTO.search(self.spec)
        return m.group(1) if m else None

    @property
    def to_destination(self) -> str | None:
        m = _TO.search(self.spec)
        return m.group(1) if m else None

    def text(self) -> str:
        return f"-A {self.chain} {self.spec}"


@dataclass
class SavedTable:
    """One table: its chains in listed order with their policy ("-" for user chains), and rules."""

    name: str
    chains: dict[str, str] = field(default_factory=dict)
    rules: list[SavedRule] = field(default_factory=list)
    _by_chain: dict[str, list[SavedRule]] = field(default_factory=dict, repr=False)

    def add(self, rule: SavedRule) -> None:
        self.rules.append(rule)
        self._by_chain.setdefault(rule.chain, []).append(rule)

    def in_chain(self, chain: str) -> list[SavedRule]:
        return list(self._by_chain.get(chain, ()))

    def user_chains(self) -> list[str]:
        return [c for c, policy in self.chains.items() if policy == "-"]


def parse(text: str) -> dict[str, SavedTable]:
    """Tables by name from iptables-save output (comment lines and COMMIT skipped)."""
    tables: dict[str, SavedTable] = {}
    table: SavedTable | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            table = tables.setdefault(line[1:].strip(), SavedTable(line[1:].strip()))
        elif table is None or not line or line.startswith("#") or line == "COMMIT":
            continue
        elif line.startswith(":"):
            name, _, rest = line[1:].partition(" ")
            table.chains[name] = rest.split(" ", 1)[0]
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            table.add(SavedRule(chain, spec))
    return tables
