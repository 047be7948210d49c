"""C21: changing one service disturbs no other; diffs apply per port and release everything on delete.

Fault class: config reconciliation. Listeners are diffed per (IP, port, protocol): a change to one
port (target port, removal) touches nothing else, bursts of updates are coalesced, a deleted
Service releases its listeners and addresses, re-creating it rebinds at once (no EADDRINUSE with
TIME_WAIT sockets on its address), and churn of unrelated Services leaves no listener behind.
Addresses of deleted Services stay local for a while, without listeners, so their clients are
refused (ECONNREFUSED) rather than left to time out.

Numbers as in the case: 100 connections/s to `steady` and to multi:80 throughout, 0 failures for
`steady` in every step and for multi:80 until it is deleted; each change in force within 1 s
(:80 lands on :9090, :443 and :30443 refused, after the flips the last state in force, then nothing
to be-b once it is not ready, ports refused after the
delete, working again after the re-create, which is written as soon as the delete took effect);
the flip storm costs at most one core and no memory
growth (8 MiB allowance); listeners return to baseline, and the deleted Services' ClusterIPs refuse. The :9090 backends close
first, so the proxy's accepted sockets on 10.96.160.160:80 are left in TIME_WAIT before the delete.
Reductions: 50 ready flips in 2.5 s instead of 200 in 10 s, and 100 unrelated Services created and
deleted over 2 s instead of 500 over 10 s (the same rates).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.relay.case_c21 import BE, BE_S, MULTI, NODE, STEADY, Load, failures, multi, steady, wait_past
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, start_server, wait_until

pytestmark = pytest.mark.netns


def unrelated(i: int) -> list[dict[str, Any]]:
    name = f"tmp-{i}"
    return [svc(name, f"10.96.161.{i}", [{"port": 80, "targetPort": 8080}]),
            slice_(name, [{"ip": BE_S, "ready": True}], [{"port": 8080, "protocol": "TCP"}])]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, USER_HZ ticks


def rss(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def listeners(node: str) -> set[str]:
    return {line.split()[3] for line in nsexec(node, "ss", "-ltnH").stdout.splitlines()}


def vip_addresses(node: str) -> set[str]:
    out = nsexec(node, "ip", "-o", "-4", "addr", "show", "dev", "usproxy0").stdout
    return {line.split()[3] for line in out.splitlines()}


def test_reconcile_per_port(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    for name, ip in BE.items():
        ns = topology.add_host(name, ip)
        for port in (8080, 8443):
            backends.start(ns, "idsrv", f"{name}:{port}", ip, str(port))
        start_server(backends, ns, "hello", ip, "9090", "--name", f"{name}:9090")
    backends.start(topology.add_host("bes", BE_S), "idsrv", "be-s", BE_S, "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*multi(), *steady())
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        base_listeners, base_vips = listeners(topology.node), vip_addresses(topology.node)
        with Load(cli, STEADY, 80).running() as st, Load(cli, MULTI, 80).running() as mu:
            time.sleep(0.3)
            # (1) http's targetPort 8080 → 9090.
            t1 = m.write(*multi(http_target=9090), *steady())
            wait_past(t1 + 1.5)
            assert {r[2].rpartition(":")[2] for r in mu.between(t1 + 1.0)} == {"9090"}

            # (2) https removed: refused within 1 s; :80 unaffected.
            t2 = m.write(*multi(http_target=9090, https=False), *steady())
            wait_past(t2 + 1.0)
            with inside(cli):
                assert attempt(MULTI, 443).kind == "refused"
                assert attempt(NODE, 30443).kind == "refused"
                assert attempt(NODE, 30080).kind == "ok"

            # (3) be-b's ready condition flips 50 times in 2.5 s (ending ready, as it began).
            cpu0, rss0, t3 = cpu_seconds(agent.pid()), rss(agent.pid()), time.monotonic()
            for i in range(1, 51):
                m.write(*multi(http_target=9090, https=False, b_ready=i % 2 == 0), *steady())
                wait_past(t3 + i * 0.05)
            t_last = time.monotonic()
            wait_past(t_last + 1.0)
            assert cpu_seconds(agent.pid()) - cpu0 <= time.monotonic() - t3  # at most one core
            assert rss(agent.pid()) <= rss0 + 8 * 2**20
            eps = next(s for s in agent.services() if s["servicePortName"].startswith("default/multi:http"))
            assert [(e["address"], e["ready"]) for e in eps["endpoints"]] == \
                [(f"{BE['be-a']}:9090", True), (f"{BE['be-b']}:9090", True)]
            wait_past(t_last + 1.5)
            assert {r[2] for r in mu.between(t_last + 1.0)} == {"be-a:9090", "be-b:9090"}
            t_nr = m.write(*multi(http_target=9090, https=False, b_ready=False), *steady())
            wait_past(t_nr + 1.5)
            assert {r[2] for r in mu.between(t_nr + 1.0)} == {"be-a:9090"}

            # (4) delete multi: its ClusterIP ports and NodePorts are refused within 1 s.
            time_wait = nsexec(topology.node, "ss", "-tanH", "state", "time-wait", "src", f"{MULTI}:80").stdout
            assert time_wait.strip(), "no TIME_WAIT socket on the ClusterIP to rebind over"
            t4 = m.write(*steady())
            with inside(cli):
                for front in ((MULTI, 80), (NODE, 30080)):
                    seen: list[str] = []

                    def refused(front: tuple[str, int] = front, seen: list[str] = seen) -> bool:
                        seen.append(attempt(*front).kind)
                        return seen[-1] == "refused"
                    assert wait_until(refused, t4 + 1.0 - time.monotonic(), 0.0), (front, seen[-5:])
            assert not any(a.startswith(f"{MULTI}:") or a.endswith((":30080", ":30443"))
                           for a in listeners(topology.node))

            # (5) re-created as soon as the delete took effect: works again within 1 s, no EADDRINUSE.
            t5 = m.write(*multi(http_target=9090, https=False), *steady())
            assert t5 - t4 < 1.2
            wait_past(t5 + 1.0)
            with inside(cli):
                assert attempt(MULTI, 80).kind == "ok"
                assert attempt(NODE, 30080).kind == "ok"
            assert "in use" not in (workdir / "agent.log").read_text()
            assert failures(mu.between(0.0, t4)) == [] and failures(mu.between(t5 + 1.0)) == []

            # (6) 100 unrelated Services created and deleted over 2 s.
            t6 = time.monotonic()
            for i in range(100):
                m.write(*multi(http_target=9090, https=False), *steady(),
                        *(obj for k in range(max(0, i - 9), i + 1) for obj in unrelated(k)))
                wait_past(t6 + (i + 1) * 0.02)
            t_end = m.write(*multi(http_target=9090, https=False), *steady())
            wait_past(t_end + 1.0)
            released = vip_addresses(topology.node) - base_vips  # the unrelated Services the agent saw
            assert released and all(a.startswith("10.96.161.") for a in released)
            with inside(cli):
                assert {attempt(a.split("/")[0], 80).kind for a in released} == {"refused"}
        assert failures(st.records) == []
        assert base_vips <= vip_addresses(topology.node)
        assert listeners(topology.node) == base_listeners - {f"{MULTI}:443", f"{NODE}:30443",
                                                             "192.0.2.11:30443", "10.244.0.1:30443"}
    finally:
        assert agent.stop() == 0
