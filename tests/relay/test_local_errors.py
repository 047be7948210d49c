"""Everything withdrawn on a local error, and a file rewritten in place (issue 18 item 4), on the
real agent in a node netns with a low descriptor limit.

Before: idle connections to the health port took every descriptor, the manifest directory then
listed as empty and every Service was withdrawn; a manifest rewritten in place (`kubectl get -o
yaml > file`: truncated, then written) was read empty or half, and connections were refused. Here
the health port is flooded with idle connections and the manifest is rewritten in place, slowly,
while a client keeps connecting to the ClusterIP: every connection is served.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import yaml

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, wait_until

pytestmark = pytest.mark.netns
HTTP = [{"name": "http", "port": 8080, "protocol": "TCP"}]
NOFILE = 256


def web(cluster_ip: str) -> list[dict[str, object]]:
    return [svc("web", cluster_ip, [{"name": "http", "port": 80, "targetPort": 8080}]),
            slice_("web", [{"ip": "10.244.1.5", "ready": True}], HTTP)]


def flood_health_port(ns: str, count: int) -> list[socket.socket]:
    """`count` idle connections to the agent's health port (over its limit the agent closes the
    one idle the longest)."""
    held = []
    deadline = time.monotonic() + 10.0
    with inside(ns):
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", 10256))
            except OSError:
                s.close()
                continue
            held.append(s)
    return held


def test_everything_withdrawn_on_a_local_error_and_a_file_rewritten_in_place(
        topology: Topology, backends: Backends, workdir: Path) -> None:
    ns = topology.add_host("be1", "10.244.1.5")
    backends.start(ns, "idsrv", "be1", "10.244.1.5", "8080")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    m.write(*web("10.96.10.10"))
    agent = AgentProc(topology, m)
    agent.wrapper = ("prlimit", f"--nofile={NOFILE}:{NOFILE}")
    held: list[socket.socket] = []
    outcomes: list[str] = []

    def probe() -> None:
        with inside(cli):
            outcomes.append(attempt("10.96.10.10", 80, timeout=2.0).kind)

    try:
        agent.start()
        held = flood_health_port(topology.node, 2 * NOFILE)  # more than the agent may hold at all
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{agent.pid()}/fd")) < NOFILE
        for _ in range(10):
            probe()
        # Rewritten in place, as a shell redirection does: truncated, empty while the API call
        # runs, then written in two pieces of which the first parses (the Service, no endpoints).
        objs = web("10.96.10.10") + [svc("web2", "10.96.10.11", [{"name": "http", "port": 80, "targetPort": 8080}]),
                                     slice_("web2", [{"ip": "10.244.1.5", "ready": True}], HTTP)]
        text = "---\n".join(yaml.safe_dump(o) for o in objs)
        cut = text.index("---\n") + 4  # the first piece: Service web alone, without its endpoints
        with open(m.path, "w") as f:  # truncates
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                probe()
                time.sleep(0.05)
            f.write(text[:cut])
            f.flush()
            probe()
            time.sleep(0.1)
            f.write(text[cut:])
        for _ in range(10):
            probe()
            time.sleep(0.05)
        assert outcomes and set(outcomes) == {"ok"}, outcomes
        assert "default/web:http" in {r["servicePortName"] for r in agent.services()}  # metrics port still serves
        assert wait_until(lambda: attempt_in(cli, "10.96.10.11", 80) == "ok", timeout=3.0)
        log = agent.log.read_text()
        assert "withdrawing" not in log and "Too many open files" not in log
        # the health port's limit was what held: over it, idle connections closed to make room
        # (or, in a burst of accepts none of which had started, the new one reset)
        assert "closing the one idle the longest" in log or "refusing more" in log
    finally:
        for s in held:
            s.close()
        assert agent.stop() == 0


def attempt_in(ns: str, addr: str, port: int) -> str:
    with inside(ns):
        return attempt(addr, port, timeout=1.0).kind
