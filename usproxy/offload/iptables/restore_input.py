"""TableWrite: what one iptables-restore --noflush input does to one table, and its text.

With --noflush, iptables-restore changes only what its input names: a chain line (`:NAME - [0:0]`)
creates the chain or flushes it, the rules that follow fill it, `-I BASE 1 ...` inserts at the top
of a built-in chain (the entry jumps) and `-D BASE spec` deletes one rule there, `-X NAME` deletes
a chain, and each table's COMMIT applies
all of it at once (one kernel transaction per table with iptables-nft; one table blob replaced
with iptables-legacy). Rules of programs that the input does not name stay as they are. This is
how kube-proxy writes every sync (pkg/proxy/iptables/proxier.go: natChains, natRules, `-X` of
stale chains). Nothing here knows about Services, so the IPVS mode's helper chains write through
it the same way.

Order inside a table, as iptables needs it: the chain lines of written and deleted chains (every
one of them is flushed before any rule refers to it), the rules, the edits of built-in chains,
then `-X` of the deleted chains, whose referring rules were flushed or deleted by then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TableWrite:
    """Chains to write (each flushed and given `rules`, rule lines "-A CHAIN ..."), chains to
    delete, and edits of built-in chains ("-I INPUT 1 ...", "-D INPUT ...")."""

    table: str
    chains: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    edits: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.chains or self.delete or self.edits)

    def lines(self) -> list[str]:
        out = [f"*{self.table}"]
        out += [f":{c} - [0:0]" for c in (*self.chains, *self.delete)]
        out += self.rules
        out += self.edits
        out += [f"-X {c}" for c in self.delete]
        out.append("COMMIT")
        return out


def render(writes: Sequence[TableWrite]) -> str:
    """The restore input of `writes` (tables that change nothing are left out; "" if none)."""
    lines = [line for w in writes if not w.empty() for line in w.lines()]
    return "\n".join(lines) + "\n" if lines else ""
