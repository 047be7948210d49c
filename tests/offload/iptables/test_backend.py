"""Choosing the iptables backend as kube-proxy's iptables-wrapper does (kubelet's hint chain,
then more rules), and never one the kernel cannot run (backend.choose)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from usproxy.offload.iptables.backend import Tools, choose, detect


def saves(**outputs: str | None) -> Callable[[list[str]], str | None]:
    """A `run` that answers iptables-save commands with `outputs` keyed "legacy4", "nft6", ...
    (with "-t mangle": key + "mangle"); anything else fails."""

    def run(argv: list[str]) -> str | None:
        tool = argv[0]
        if not tool.endswith("-save"):
            return None
        family = "6" if tool.startswith("ip6") else "4"
        key = tool.split("-")[1] + family + ("mangle" if "-t" in argv else "")
        return outputs.get(key, "")

    return run


RULES = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\n-A INPUT -j DROP\nCOMMIT\n"
HINT = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"


def test_a_kubelet_hint_in_nft_wins_over_more_legacy_rules() -> None:
    assert detect(saves(nft4mangle=HINT, legacy4=RULES * 5))[0] == "nft"


def test_a_kubelet_hint_in_legacy_wins_over_more_nft_rules() -> None:
    backend, why = detect(saves(legacy6=HINT.replace("IPTABLES-HINT", "KUBELET-CANARY"), nft4=RULES * 5))
    assert (backend, why) == ("legacy", "kubelet's hint chain is in iptables-legacy")


def test_without_hints_the_backend_with_more_rules_wins_and_nft_a_tie() -> None:
    assert detect(saves(legacy4=RULES, legacy6=RULES, nft4=RULES))[0] == "legacy"
    assert detect(saves(legacy4=RULES, nft6=RULES))[0] == "nft"
    assert detect(saves())[0] == "nft"  # a fresh node: nothing anywhere


def test_a_backend_the_kernel_cannot_run_gives_way_to_the_other() -> None:
    run = saves()  # detect says nft (a tie)
    backend, why = choose(run, lambda b: "no nf_tables" if b == "nft" else None)
    assert backend == "legacy" and "iptables-nft does not work here (no nf_tables)" in why
    assert choose(run, lambda b: None)[0] == "nft"
    with pytest.raises(LookupError, match="iptables-nft: a; iptables-legacy: b"):
        choose(run, lambda b: "a" if b == "nft" else "b")


def test_tools_are_named_by_backend_never_by_the_alternative() -> None:
    t = Tools("legacy")
    assert t.restore(6)[:2] == ["ip6tables-legacy-restore", "--noflush"]
    assert t.save(4, "nat") == ["iptables-legacy-save", "-t", "nat"]
    assert Tools("nft").command(4) == "iptables-nft"
