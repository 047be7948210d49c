"""C01: a TCP service with zero endpoints refuses at once, and works as soon as an endpoint appears.

Fault class: endpoint-set edge cases. Zero usable endpoints must be refused by the kernel
(ECONNREFUSED within 1 s, never a hang, never accept-then-close), and no negative "no backend"
state may survive a 0→N change, on ClusterIPs and NodePorts alike; an unrelated service keeps
working throughout.

Numbers as in the case: 100 attempts per frontend and phase (3 s connect timeout), refused within
1 s each with median under 50 ms, 100 of 100 after T_upd + 1 s, 100 of 100 for `control`. No
reductions. The degraded form (connect, then ECONNRESET) is not a pass; the relay listens only
while there are usable endpoints, so here it counts as a failure. Within the second after T_upd
either outcome may be seen, and on N→0 also a reset (a connection the kernel queued on the
listener just before it closed).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import Outcome, attempt, median

pytestmark = pytest.mark.netns

WEB = ("10.96.10.10", 80)
NODEPORT = ("192.0.2.10", 30080)
CONTROL = ("10.96.10.11", 80)
PORTS = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def manifests(web_endpoints: list[dict[str, object]]) -> list[dict[str, object]]:
    return [
        svc("web", WEB[0], [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
            type="NodePort", sessionAffinity="None"),
        slice_("web", web_endpoints, PORTS),
        svc("control", CONTROL[0], [{"name": "http", "port": 80, "targetPort": 8080}]),
        slice_("control", [{"ip": "10.244.2.5", "ready": True}], PORTS),
    ]


def refused_phase(cli: str, label: str) -> None:
    """100 attempts per frontend: all refused within 1 s, median < 50 ms; control answers each time."""
    for front in (WEB, NODEPORT):
        outcomes: list[Outcome] = []
        for _ in range(100):
            with inside(cli):
                outcomes.append(attempt(*front, timeout=3.0))
                assert attempt(*CONTROL).name == "control"
        kinds = {o.kind for o in outcomes}
        assert kinds == {"refused"}, f"{label} {front}: {sorted(kinds)}"
        assert max(o.elapsed for o in outcomes) < 1.0
        assert median(o.elapsed for o in outcomes) < 0.05


def test_zero_endpoints_refuse_then_work(topology: Topology, backends: Backends, workdir: Path,
                                         loop_name: str) -> None:
    be1 = topology.add_host("be1", "10.244.1.5")
    backends.start(be1, "idsrv", "be-1", "10.244.1.5", "8080")
    bec = topology.add_host("bec", "10.244.2.5")
    backends.start(bec, "idsrv", "control", "10.244.2.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*manifests([]))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        refused_phase(cli, "phase 1")

        t_upd = m.write(*manifests([{"ip": "10.244.1.5", "ready": True}]))
        while time.monotonic() < t_upd + 1.0:  # the change may land any time in this second
            with inside(cli):
                assert attempt(*WEB).kind in ("refused", "ok")
        for front in (WEB, NODEPORT):
            for _ in range(100):
                with inside(cli):
                    got = attempt(*front)
                    assert (got.kind, got.name) == ("ok", "be-1"), front
                    assert attempt(*CONTROL).name == "control"

        t_upd = m.write(*manifests([]))
        while time.monotonic() < t_upd + 1.0:  # a connection still queued on the closing listener is reset
            with inside(cli):
                assert attempt(*WEB).kind in ("refused", "ok", "reset")
        refused_phase(cli, "phase 3")
    finally:
        assert agent.stop() == 0
