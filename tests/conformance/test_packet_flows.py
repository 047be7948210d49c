"""kube-proxy's packet-flow expectations (tests/conformance/reference.py) as real traffic through
the agent in network namespaces, once per datapath (tests/conformance/datapaths.py): its nftables
tests for most, its iptables tests for the iptables datapath.

One test per (datapath, scenario, flow), ids "datapath/scenario/flow name". Tests are ordered so
that each (datapath, group) runs on one agent and phase 1 flows (after endpoints or a Service are
deleted) follow phase 0; `Lab.use` switches agents and phases. A flow is judged by its attempts:
- endpoints "a:p, b:p": every attempt answered, the set of endpoints that answered equals the
  expected set, and the peer each endpoint saw is the client's own address (not masqueraded, and
  always for the expectation's `client_kept` endpoints) or a node address other than the client's
  (masqueraded);
- REJECT: every attempt refused (ECONNREFUSED, TCP RST or ICMP port unreachable) within 0.5 s;
- DROP: no answer and no error before the 1 s timeout;
- BLOCKED: no endpoint reached, refused or silent;
- "" (no rule matches): no endpoint answered;
- ACCEPT: an HTTP status line from the health check server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conformance import addresses as A
from tests.conformance.datapaths import DATAPATHS, Expectation, expectation, groups_of, pending, serves
from tests.conformance.lab import Lab
from tests.conformance.manifests import scenario_index
from tests.conformance.probe import Attempt, Spec
from tests.conformance.reference import Flow, Group, Scenario

pytestmark = pytest.mark.netns

DROP_TIMEOUT = 1.0
Case = tuple[str, Group, Scenario, Flow]


def _cases() -> Iterator[object]:
    for datapath in DATAPATHS:
        for group in groups_of(datapath):
            for phase in (0, 1):
                for sc in group.scenarios:
                    k = scenario_index(group, sc)
                    for flow in sc.flows:
                        if flow.phase != phase or not serves(datapath, A.addr(flow.source, k), A.addr(flow.dest, k)):
                            continue
                        p = pending(datapath, sc, flow)
                        marks = [pytest.mark.xfail(strict=True, reason=p.reason())] if p else []
                        yield pytest.param((datapath, group, sc, flow), marks=marks,
                                           id=f"{datapath}/{sc.key}/{flow.name}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(tmp_path_factory.mktemp("conformance"))
    try:
        lab.build()
        yield lab
    finally:
        lab.close()


@pytest.mark.parametrize("case", list(_cases()))
def test_flow(lab: Lab, case: Case) -> None:
    datapath, group, sc, flow = case
    lab.use(datapath, group, flow.phase)
    k = scenario_index(group, sc)
    exp = expectation(datapath, sc, flow)
    src, dst = A.addr(flow.source, k), A.addr(flow.dest, k)
    port = A.node_port(flow.port, k) if flow.port >= 3000 else flow.port
    wanted = _endpoints(exp.output, k)
    attempts = lab.probe(datapath, _spec(exp, flow, src, dst, port, wanted))
    problems = judge(exp, attempts, src, wanted, _endpoints(", ".join(exp.client_kept), k))
    assert not problems, f"{sc.test}: {flow.name!r} {src} -> {dst}:{port}/{flow.protocol} " \
                         f"expected {exp}: {problems}; attempts {[_short(a) for a in attempts[:6]]}"


def _endpoints(output: str, k: int) -> set[str]:
    if output in ("REJECT", "DROP", "", "ACCEPT", "BLOCKED"):
        return set()
    out = set()
    for item in output.split(", "):
        ip, port = item.rsplit(":", 1)
        out.add(f"{A.addr(ip, k)}:{port}")
    return out


def _spec(exp: Expectation, flow: Flow, src: str, dst: str, port: int, wanted: set[str]) -> Spec:
    mode = "http" if exp.output == "ACCEPT" else flow.protocol.lower()
    if wanted:
        return Spec(mode, src, dst, port, max(12, 10 * len(wanted)), 2.0)
    if exp.output == "REJECT":
        return Spec(mode, src, dst, port, 3, 2.0)
    return Spec(mode, src, dst, port, 1, DROP_TIMEOUT if exp.output in ("DROP", "BLOCKED", "") else 2.0)


def judge(exp: Expectation, attempts: list[Attempt], src: str, wanted: set[str],
          kept: set[str] | None = None) -> list[str]:
    """What is wrong with `attempts` under `exp` (empty: conforms); `kept`: the mapped endpoints
    that must see `src` whatever exp.masq says."""
    answered = [a for a in attempts if not a.error]
    errors = sorted({a.error for a in attempts if a.error})
    if wanted:
        problems = [f"errors {errors}"] if errors else []
        seen = {a.endpoint for a in answered}
        if seen != wanted:
            problems.append(f"endpoints {sorted(seen)} != {sorted(wanted)}")
        kept = kept or set()
        if any(a.peer != src for a in answered if a.endpoint in kept):
            problems.append(f"client address lost: {sorted({(a.endpoint, a.peer) for a in answered if a.endpoint in kept})}")
        others = [a for a in answered if a.endpoint not in kept]
        if exp.masq is True and any(a.peer == src or not A.is_node(a.peer) for a in others):
            problems.append(f"not masqueraded: peers {sorted({a.peer for a in others})}")
        if exp.masq is False and any(a.peer != src for a in others):
            problems.append(f"masqueraded: peers {sorted({a.peer for a in others})}")
        return problems
    if exp.output == "ACCEPT":
        return [] if answered and all(a.endpoint.startswith("HTTP/") for a in answered) and not errors \
            else [f"no health check answer: {errors or [a.endpoint for a in answered]}"]
    if answered:
        return [f"answered by {sorted({a.endpoint for a in answered})}"]
    if exp.output == "REJECT":
        # Refused at once, not after a timeout: one attempt refused only after a retransmitted SYN
        # (1 s: seen once on a loaded machine) is still a REJECT, so the fastest attempt is judged.
        fastest = min((a.seconds for a in attempts), default=0.0)
        return ([f"not refused: {errors}"] if errors != ["ECONNREFUSED"] else []) + \
            ([f"slow: {sorted(round(a.seconds, 2) for a in attempts)}"] if fastest > 0.5 else [])
    if exp.output == "DROP":
        return [] if errors == ["timeout"] else [f"not dropped: {errors}"]
    if exp.output == "BLOCKED":
        return [] if set(errors) <= {"timeout", "ECONNREFUSED"} else [f"not blocked: {errors}"]
    return []  # "": no rule matches, no endpoint answered


def _short(a: Attempt) -> str:
    return a.error or f"{a.endpoint}<-{a.peer}"
