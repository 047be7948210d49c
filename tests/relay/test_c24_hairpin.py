"""C24 (TCP part): hairpin: a backend calling its own service through the relay.

Fault class: hairpin NAT and source selection. A connection from an endpoint to its own Service may
be sent back to that same endpoint; the reply must come back the way it went (in userspace the
relay is a real peer on both legs, so it does), whether the caller is the only endpoint or one of
several.

Numbers as in the case (TCP): from inside be-a, 100 connections while be-a is the only endpoint,
all answered by be-a; then be-b is added and 300 more, all answered, 150 ± 30 of them by be-a
itself. No reductions; the UDP part belongs to the UDP tests.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import ask

pytestmark = pytest.mark.netns

VIP = "10.96.190.190"
BE_A, BE_B = "10.244.1.70", "10.244.2.70"


def objects(ips: list[str]) -> list[dict[str, Any]]:
    return [svc("self", VIP, [{"port": 80, "targetPort": 8080}]),
            slice_("self", [{"ip": ip, "ready": True} for ip in ips], [{"port": 8080, "protocol": "TCP"}])]


def test_backend_calls_its_own_service(topology: Topology, backends: Backends, workdir: Path,
                                       loop_name: str) -> None:
    be_a = topology.add_host("bea", BE_A)
    backends.start(be_a, "idsrv", "be-a", BE_A, "8080")
    backends.start(topology.add_host("beb", BE_B), "idsrv", "be-b", BE_B, "8080")
    m = Manifests(workdir)
    m.write(*objects([BE_A]))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        with inside(be_a):
            assert Counter(ask(VIP, 80) for _ in range(100)) == {"be-a": 100}
        t_upd = m.write(*objects([BE_A, BE_B]))
        time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
        with inside(be_a):
            got = Counter(ask(VIP, 80) for _ in range(300))
        assert sum(got.values()) == 300 and set(got) == {"be-a", "be-b"}
        assert abs(got["be-a"] - 150) <= 30, got
    finally:
        assert agent.stop() == 0
