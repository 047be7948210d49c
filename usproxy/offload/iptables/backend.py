"""Which iptables the node uses (iptables-legacy or iptables-nft), and that backend's tools.

A node runs one of two kernels' worth of iptables: the legacy x_tables or nf_tables through
iptables-nft. Rules written through the other one are still enforced, but every other program
(kubelet, Docker, a firewall) reads and writes the node's own, so a service proxy must use the
same. `detect` decides as kube-proxy's image does (kubernetes-sigs/iptables-wrappers'
iptables-wrapper): a kubelet's hint chain (KUBE-IPTABLES-HINT, or KUBE-KUBELET-CANARY) in the
mangle table of iptables-nft, then of iptables-legacy; otherwise the backend holding more rules
(lines starting "-" in iptables-save of both families), nft when they tie. An earlier usproxy
run's own KUBE-* rules count like any other program's, so a restart keeps its backend.

Beyond the wrapper, a backend the kernel cannot run is never chosen when the other one works
(`choose`): a kernel without nf_tables (the VM lab boots one) answers iptables-nft with errors,
and one without ip_tables the legacy tools. Tools are called by their backend's own names
(iptables-nft-restore, ip6tables-legacy-save, ...), never through the /usr/sbin/iptables
alternative, which may point at the other one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

Backend: TypeAlias = Literal["nft", "legacy"]
BACKENDS: tuple[Backend, ...] = ("nft", "legacy")  # the wrapper's order: nft wins a tie
Family: TypeAlias = Literal[4, 6]
HINT_CHAINS = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) ", re.M)
RULE_LINE = re.compile(r"^-", re.M)
WAIT = ("--wait", "10")  # the xtables lock is node-wide: wait for it (kube-proxy waits 5 s)

Run: TypeAlias = Callable[[list[str]], "str | None"]
"""Runs a command, returns its stdout, or None when it cannot be run or fails."""


@dataclass(frozen=True, slots=True)
class Tools:
    """The commands of one backend."""

    backend: Backend

    def command(self, family: Family, verb: str = "") -> str:
        """e.g. iptables-nft-restore, ip6tables-legacy-save, iptables-nft (verb "")."""
        base = "iptables" if family == 4 else "ip6tables"
        return f"{base}-{self.backend}" + (f"-{verb}" if verb else "")

    def restore(self, family: Family) -> list[str]:
        """iptables-restore that keeps what the input does not name (kube-proxy's NoFlushTables)."""
        return [self.command(family, "restore"), "--noflush", *WAIT]

    def save(self, family: Family, table: str | None = None) -> list[str]:
        return [self.command(family, "save"), *(("-t", table) if table else ())]


def detect(run: Run) -> tuple[Backend, str]:
    """(the backend the node uses, why), as iptables-wrapper decides."""
    nft = _saved(run, "nft", "mangle")
    if HINT_CHAINS.search(nft):
        return "nft", "kubelet's hint chain is in iptables-nft"
    # legacy-save of one table would create it in the kernel: read all of them
    legacy = _saved(run, "legacy")
    if HINT_CHAINS.search(legacy):
        return "legacy", "kubelet's hint chain is in iptables-legacy"
    n_legacy, n_nft = len(RULE_LINE.findall(legacy)), len(RULE_LINE.findall(_saved(run, "nft")))
    if n_legacy > n_nft:
        return "legacy", f"no kubelet hint chain; iptables-legacy holds more rules than iptables-nft ({n_legacy} against {n_nft})"
    return "nft", (f"no kubelet hint chain; iptables-nft holds at least as many rules as iptables-legacy "
                   f"({n_nft} against {n_legacy})")


def choose(run: Run, usable: Callable[[Backend], str | None]) -> tuple[Backend, str]:
    """detect(), unless the kernel cannot run that backend and can run the other: `usable`
    returns why a backend does not work here (None: it works). Raises LookupError naming both
    reasons when neither works."""
    backend, why = detect(run)
    fault = usable(backend)
    if fault is None:
        return backend, why
    other: Backend = "legacy" if backend == "nft" else "nft"
    other_fault = usable(other)
    if other_fault is None:
        return other, f"iptables-{backend} does not work here ({fault}); iptables-{other} does"
    raise LookupError(f"iptables-{backend}: {fault}; iptables-{other}: {other_fault}")


def _saved(run: Run, backend: Backend, table: str | None = None) -> str:
    tools = Tools(backend)
    return "".join(run(tools.save(f, table)) or "" for f in (4, 6))
