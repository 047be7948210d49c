"""C16: affinity that points at a failing or removed endpoint, and affinity across endpoint rebuilds.

Fault class: affinity state lifecycle. A pin is dropped when its endpoint refuses or is removed (and
nothing reaches a removed endpoint after T_upd + 1 s, even while it still listens), affinity is
enforced again after the endpoint set went to zero and came back with new addresses, and switching
sessionAffinity off and on takes effect within 1 s; pins to endpoints that remain survive updates.

Numbers as in the case: 20 connections stay on the new endpoint after the pinned one refused,
50 connections after 0→N go to one backend, 300 connections with sessionAffinity None give each
backend at least 60, then sticky again within 1 s. No reductions. To see a stale pin in step 3, X
is listening again when it is removed, and a second client IP is pinned to it first.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, ask_in, idsrv_log_after

pytestmark = pytest.mark.netns

VIP = "10.96.110.111"
NAMES = ("be-a", "be-b", "be-c")
OLD = {name: f"10.244.{i}.21" for i, name in enumerate(NAMES, 1)}
NEW = {f"{name}-new": f"10.244.{i}.22" for i, name in enumerate(NAMES, 1)}
CLIENT = "10.244.9.10"
OTHERS = [f"10.244.9.{i}" for i in range(11, 31)]


def objects(ips: list[str], affinity: str = "ClientIP") -> list[dict[str, Any]]:
    spec: dict[str, Any] = {"sessionAffinity": affinity}
    if affinity == "ClientIP":
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}
    return [svc("sticky", VIP, [{"port": 80, "targetPort": 8080}], **spec),
            slice_("sticky", [{"ip": ip, "ready": True} for ip in ips], [{"port": 8080, "protocol": "TCP"}])]


def test_affinity_lifecycle(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    hosts = {name: topology.add_host(name, OLD[name], NEW[f"{name}-new"]) for name in NAMES}
    logs = {name: workdir / f"{name}.log" for name in NAMES}

    def serve(name: str) -> subprocess.Popen[bytes]:
        return backends.start(hosts[name], "idsrv", name, OLD[name], "8080", "--log", str(logs[name]))
    procs = {name: serve(name) for name in NAMES}
    for name in NAMES:
        backends.start(hosts[name], "idsrv", f"{name}-new", NEW[f"{name}-new"], "8080")
    cli = topology.add_host("cli", CLIENT, *OTHERS)

    def ask(source: str = CLIENT) -> str:
        return ask_in(cli, VIP, 80, source)

    m = Manifests(workdir)
    m.write(*objects(list(OLD.values())))
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        # (1) pinned to X.
        x = ask()
        assert {ask() for _ in range(5)} == {x}

        # (2) X's listener closes while X is still listed: the next connection moves within 1 s.
        backends.stop(procs[x])
        t0 = time.monotonic()
        y = ask()
        assert time.monotonic() - t0 <= 1.0 and y != x
        assert {ask() for _ in range(20)} == {y}

        # (3) X listens again; another client gets pinned to it; then X is removed.
        procs[x] = serve(x)
        deadline = time.monotonic() + 6.0
        pinned_to_x = None
        for source in OTHERS:
            if ask(source) == x:
                pinned_to_x = source
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)  # X may still be backing off after its failure
        assert pinned_to_x is not None, "no new client was ever sent to X again"
        assert {ask(pinned_to_x) for _ in range(3)} == {x}
        t_upd = m.write(*objects([ip for name, ip in OLD.items() if name != x]))
        while time.monotonic() < t_upd + 1.0:
            ask(pinned_to_x)
        assert ask(pinned_to_x) != x, "the pin to the removed endpoint survived"
        assert ask() == y, "a pin to an endpoint that remains did not survive the update"
        assert {ask(source) for source in [CLIENT, *OTHERS]} <= set(NAMES) - {x}
        assert idsrv_log_after(logs[x], t_upd + 1.0) == []

        # (4) scale to 0, then to three new addresses: affinity is enforced again.
        t_upd = m.write(*objects([]))
        time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
        with inside(cli):
            assert attempt(VIP, 80).kind == "refused"
        t_upd = m.write(*objects(list(NEW.values())))
        time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
        after = {ask() for _ in range(50)}
        assert len(after) == 1 and after <= set(NEW), after

        # (5) None spreads; ClientIP is sticky again within 1 s.
        t_upd = m.write(*objects(list(NEW.values()), affinity="None"))
        time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
        spread = Counter(ask() for _ in range(300))
        assert set(spread) == set(NEW) and min(spread.values()) >= 60, spread
        t_upd = m.write(*objects(list(NEW.values())))
        time.sleep(max(0.0, t_upd + 1.0 - time.monotonic()))
        assert len({ask() for _ in range(20)}) == 1
    finally:
        assert agent.stop() == 0
