"""C08: UDP flow lifetime against slow backends, and bounded UDP flows and fds.

Fault class: flow lifetime and resource bounds. An idle timeout shorter than a backend's answer
time (the old userspace kube-proxy's 250 ms) drops slow answers; one that counts only the
client's datagrams ends flows that are still answering; a relay that opens one socket per flow
with no budget hits EMFILE under a burst of fresh source ports and then fails everything, and
one that never expires flows leaks fds and memory.

The agent runs with `--udp-idle-timeout 5s` and RLIMIT_NOFILE 1024:1024 (LimitedAgent, as
`prlimit --nofile=1024:1024`), before a backend that answers each query after the delay the query
asks for. (a) 20 queries with a 2 s delay, each from its own socket: 20 of 20 answered. The
either-direction rule: a flow whose client sent 7 s ago but whose backend answered 3 s ago is
still the same flow, and answers again. (b) one query with a 7 s delay: its answer may be lost,
the agent stays healthy and serves the next query. (c) 5,000 queries in 10 s, each from a fresh
socket: ≥ 4,995 answered, EMFILE never logged, the agent's fds never reach the limit; within
timeout + 2 s of the burst the flow table is empty and the fd count back to baseline ± 8.
No reductions.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.udp_helpers import (LimitedAgent, ask, client_socket, fd_count, nofile_limit, start_udpsrv,
                                     udp_flows)

pytestmark = pytest.mark.netns

DNS = ("10.96.0.10", 53)
IDLE = 5.0
NOFILE = 1024


def manifests(m: Manifests) -> None:
    m.write(svc("kube-dns", "10.96.0.10", [{"port": 53, "targetPort": 53, "protocol": "UDP"}],
                namespace="kube-system"),
            slice_("kube-dns", [{"ip": "10.244.1.12", "ready": True}], [{"port": 53, "protocol": "UDP"}],
                   namespace="kube-system"))


def slow_phase(cli: str, agent: AgentProc) -> None:
    """(a), (b) and the either-direction check, overlapped in time."""
    t0 = time.monotonic()
    fast = [client_socket(cli, connect=DNS) for _ in range(20)]
    both = client_socket(cli, connect=DNS)
    slow = client_socket(cli, connect=DNS)
    try:
        for i, s in enumerate(fast):
            s.send(b"delay=2000;a%d" % i)
        both.send(b"delay=4000;both")
        slow.send(b"delay=7000;b")
        answered = 0
        for i, s in enumerate(fast):
            s.settimeout(max(0.1, t0 + 4 - time.monotonic()))
            answered += s.recv(65535) == b"be-slow|delay=2000;a%d" % i
        assert answered == 20
        both.settimeout(max(0.1, t0 + 6 - time.monotonic()))
        assert both.recv(65535) == b"be-slow|delay=4000;both"
        port = both.getsockname()[1]
        before = [f["id"] for f in udp_flows(agent) if f["original"]["src"] == f"10.244.9.10:{port}"]
        time.sleep(max(0.0, t0 + 7 - time.monotonic()))  # client silent 7 s, backend spoke 3 s ago
        after = [f["id"] for f in udp_flows(agent) if f["original"]["src"] == f"10.244.9.10:{port}"]
        assert after == before and len(after) == 1, "the flow expired though its backend answered recently"
        both.send(b"again")
        assert both.recv(65535) == b"be-slow|again"
        slow.settimeout(max(0.1, t0 + 8 - time.monotonic()))
        try:
            slow.recv(65535)  # may be lost: the flow idled out before the answer
        except TimeoutError:
            pass
    finally:
        for s in (*fast, both, slow):
            s.close()


class Burst:
    """`n` queries spread over `duration` seconds, each on a fresh connected socket, from a thread
    that lives in the client netns; every socket waits up to 2 s for its answer."""

    def __init__(self, ns: str, n: int, duration: float) -> None:
        self.ns, self.n, self.duration = ns, n, duration
        self.answered = 0
        self.wrong = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with inside(self.ns):
                self._run()
        except BaseException as err:  # re-raised by the test thread
            self.error = err

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        open_: dict[socket.socket, tuple[float, bytes]] = {}
        t0 = time.monotonic()
        sent = 0
        while sent < self.n or open_:
            now = time.monotonic()
            while sent < self.n and t0 + sent * self.duration / self.n <= now:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setblocking(False)
                s.connect(DNS)
                q = b"c%d" % sent
                s.send(q)
                open_[s] = (now + 2.0, q)
                sel.register(s, selectors.EVENT_READ)
                sent += 1
            for key, _ in sel.select(timeout=0.002):
                self._answer(sel, open_, key.fileobj)  # type: ignore[arg-type]
            for s in [s for s, (deadline, _) in open_.items() if deadline < now]:
                self._done(sel, open_, s)
        sel.close()

    def _answer(self, sel: selectors.BaseSelector, open_: dict[socket.socket, tuple[float, bytes]],
                s: socket.socket) -> None:
        try:
            data = s.recv(65535)
        except OSError:
            data = b""
        if data == b"be-slow|" + open_[s][1]:
            self.answered += 1
        else:
            self.wrong += 1
        self._done(sel, open_, s)

    @staticmethod
    def _done(sel: selectors.BaseSelector, open_: dict[socket.socket, tuple[float, bytes]],
              s: socket.socket) -> None:
        sel.unregister(s)
        del open_[s]
        s.close()


def test_idle_timeout_and_bounds(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    start_udpsrv(backends, topology.add_host("be-slow", "10.244.1.12"), "be-slow", "10.244.1.12", 53)
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    manifests(m)
    agent = LimitedAgent(topology, m, loop_name, NOFILE, "--udp-idle-timeout", "5s")
    try:
        agent.start()
        pid = agent.pid()
        assert nofile_limit(pid) == (NOFILE, NOFILE)
        baseline = fd_count(pid)

        slow_phase(cli, agent)
        assert agent.get("/healthz", port=10256) is not None
        assert ask(cli, DNS, b"after-b") == b"be-slow|after-b"

        burst = Burst(cli, 5000, 10.0)
        thread = threading.Thread(target=burst.run)
        thread.start()
        peak = 0
        while thread.is_alive():
            peak = max(peak, fd_count(pid))
            thread.join(0.2)
        end = time.monotonic()
        assert burst.error is None
        assert burst.answered >= 4995, f"{burst.answered} answered, {burst.wrong} wrong"
        assert peak < NOFILE - 16, f"fd count reached {peak}"
        log = agent.log.read_text()
        assert "Too many open files" not in log and "EMFILE" not in log

        while True:
            flows, fds = len(agent.flows()), fd_count(pid)
            if flows == 0 and abs(fds - baseline) <= 8:
                break
            assert time.monotonic() < end + IDLE + 2, f"{flows} flows and {fds} fds (baseline {baseline}) left"
            time.sleep(0.2)
    finally:
        assert agent.stop() == 0
