"""Stale UDP conntrack entries with live sessions through the nftables offload (issue 29 items 7
and 8; field cases C03 and C20). The relay carries none of this traffic, so one event loop.

Item 7, tried: an endpoint removed while the agent was down (a DaemonSet rollout, an OOM kill)
kept a UDP session for as long as it talked: the new agent never saw the removal, so no sync
named the endpoint, and the session's DNATed entry stayed. Now every UDP entry of the UDP
Services' frontends is reconciled against the current endpoints at the first sync and after each
sync that changes a UDP ServicePort, as kube-proxy's CleanStaleEntries.

Item 8, tried: with 150,000 UDP entries pointing at a removed endpoint, a live session stayed on
it for 57 to more than 125 s (pyroute2 deleted one entry per request, under the agent's GIL), and
a second Service's removal, a second later, waited behind the first cleanup for 69 s. Now the
table is listed once and the stale entries deleted in batches in a child process; both sessions
leave their removed endpoints within seconds. The 150,000 entries are made through ctnetlink
(tests/offload/conntrack_fill.py); the two sessions are real traffic. The allowance (30 s) is
for a loaded 2-core machine: the cleanup took 3-10 s here; the old code needs minutes.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.conntrack_fill import fill_udp
from tests.offload.harness import OFFLOAD, Pods, udp_socket
from tests.offload.agent import placement, wait_for
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

PODS = {"be-a": "10.244.1.5", "be-b": "10.244.1.6", "be-c": "10.244.1.7", "be-d": "10.244.1.8"}
ALLOWANCE = 30.0


def dns(name: str, vip: str, *pods: str) -> list[dict[str, Any]]:
    ports = [{"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}]
    return [svc(name, vip, ports),
            slice_(name, [{"ip": PODS[p], "ready": True} for p in pods], [{"name": "dns", "port": 53, "protocol": "UDP"}])]


class Session:
    """A connected UDP socket with a fixed source port: one client association."""

    def __init__(self, ns: str, src_port: int, vip: str) -> None:
        self.sock = udp_socket(ns, ("10.244.9.10", src_port))
        self.sock.connect((vip, 53))
        self.sock.settimeout(0.3)

    def ask(self) -> str | None:
        """The endpoint that answers one query now (None: no answer)."""
        try:
            self.sock.send(b"q")
            return self.sock.recv(512).split(b"|")[0].decode()
        except (socket.timeout, ConnectionRefusedError):
            return None

    def settled(self) -> str:
        for _ in range(20):
            if (name := self.ask()) is not None:
                return name
        raise AssertionError("no answer")

    def close(self) -> None:
        self.sock.close()


def moved(session: Session, away_from: str, since: float) -> float:
    """Query every 0.1 s until another endpoint answers; seconds from `since` until then."""
    deadline = since + ALLOWANCE
    while time.monotonic() < deadline:
        name = session.ask()
        if name is not None and name != away_from:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"still on {away_from} {ALLOWANCE:.0f} s after its removal")


def start_pods(topology: Topology, tmp_path: Path, *names: str) -> Pods:
    pods = Pods(topology, tmp_path)
    for name in names:
        pods.add(name, PODS[name], port=53)
    return pods


def test_an_endpoint_removed_while_the_agent_was_down_loses_its_sessions(topology: Topology, tmp_path: Path) -> None:
    pods = start_pods(topology, tmp_path, "be-a", "be-b")
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(tmp_path / "m")
    m.write(*dns("dns", "10.96.0.10", "be-a", "be-b"))
    agent = AgentProc(topology, m, "uvloop", *OFFLOAD)
    session: Session | None = None
    try:
        agent.start()
        wait_for(lambda: placement(agent, "default/dns:dns")[0] == "nftables", timeout=15, what="offload")
        session = Session(cli, 41000, "10.96.0.10")
        first = session.settled()
        other = "be-b" if first == "be-a" else "be-a"
        assert agent.stop() == 0
        m.write(*dns("dns", "10.96.0.10", other))  # removed while no agent runs
        assert session.settled() == first  # its entry lives on, the pod still answers
        agent = AgentProc(topology, m, "uvloop", *OFFLOAD)
        agent.start()
        took = moved(session, first, time.monotonic())  # the old code: still on `first`, forever
        assert session.settled() == other
        entries = nsexec(topology.node, "conntrack", "-L", "-p", "udp", "-d", "10.96.0.10").stdout
        assert f"src={PODS[first]} " not in entries, entries  # no entry to the Service DNATed to it
        print(f"moved {took:.1f} s after the restart's first sync")
    finally:
        if session is not None:
            session.close()
        agent.stop()
        pods.close()


def test_150000_stale_entries_are_cleared_in_seconds_and_services_do_not_wait_for_each_other(
        topology: Topology, tmp_path: Path) -> None:
    pods = start_pods(topology, tmp_path, *PODS)
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(tmp_path / "m")
    m.write(*dns("dns", "10.96.0.10", "be-a", "be-b"), *dns("dns2", "10.96.0.11", "be-c", "be-d"))
    agent = AgentProc(topology, m, "uvloop", *OFFLOAD)
    sessions: list[Session] = []
    try:
        agent.start()
        for name in ("default/dns:dns", "default/dns2:dns"):
            wait_for(lambda: placement(agent, name)[0] == "nftables", timeout=15, what=f"{name} offloaded")
        s1, s2 = Session(cli, 41000, "10.96.0.10"), Session(cli, 41001, "10.96.0.11")
        sessions += [s1, s2]
        e1, e2 = s1.settled(), s2.settled()
        with inside(topology.node):
            assert fill_udp(150_000, ("10.96.0.10", 53), (PODS[e1], 53)) == 150_000
        keep1 = "be-b" if e1 == "be-a" else "be-a"
        keep2 = "be-d" if e2 == "be-c" else "be-c"
        t1 = m.write(*dns("dns", "10.96.0.10", keep1), *dns("dns2", "10.96.0.11", "be-c", "be-d"))
        time.sleep(1.0)
        t2 = m.write(*dns("dns", "10.96.0.10", keep1), *dns("dns2", "10.96.0.11", keep2))
        took2 = moved(s2, e2, t2)  # the second Service first: it must not wait behind the first's cleanup
        took1 = moved(s1, e1, t1)
        def entries() -> int:
            return int(nsexec(topology.node, "conntrack", "-C").stdout.strip())

        wait_for(lambda: entries() < 1000, timeout=ALLOWANCE, what="the 150,000 entries deleted")
        cleared = time.monotonic() - t1
        print(f"session 1 moved {took1:.1f} s after its endpoint's removal, session 2 {took2:.1f} s after "
              f"its own; the 150,000 entries were gone {cleared:.1f} s after the first")
    finally:
        for s in sessions:
            s.close()
        agent.stop()
        pods.close()
