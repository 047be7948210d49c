"""Live flows across the relay -> nftables handover, as data and threads: the `web` (TCP) and `dns`
(UDP) Services on three endpoints (and one more TCP Service for a warm node), long-lived TCP
connections and UDP sessions that keep talking, and the pods serving them (test_live_flows,
test_transitions)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from tests.netns import Topology, inside
from tests.offload.harness import Pods, wait_listening
from tests.relay.harness import slice_, svc

VIP, UDP_VIP, OTHER_VIP = "10.96.10.10", "10.96.10.20", "10.96.10.30"
EPS = ["10.244.1.5", "10.244.2.5", "10.244.3.5"]


def services(*, other: bool = False) -> list[dict[str, Any]]:
    """web (TCP 80) and dns (UDP 53) on three endpoints; `other`: one more TCP Service."""
    eps = [{"ip": e, "ready": True} for e in EPS]
    objs = [svc("web", VIP, [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]),
            slice_("web", eps, [{"name": "http", "port": 8080, "protocol": "TCP"}]),
            svc("dns", UDP_VIP, [{"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}]),
            slice_("dns", eps, [{"name": "dns", "port": 8080, "protocol": "UDP"}])]
    if other:
        objs += [svc("other", OTHER_VIP, [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]),
                 slice_("other", eps[:1], [{"name": "http", "port": 8080, "protocol": "TCP"}])]
    return objs


class TcpTalker(threading.Thread):
    """One TCP connection to `addr` (VIP:80) that sends a numbered line every `period` s and
    expects it echoed; `endpoint` is the name the endpoint greeted it with."""

    def __init__(self, ns: str, period: float = 0.25, addr: tuple[str, int] = (VIP, 80)) -> None:
        super().__init__(daemon=True)
        self.ns, self.period = ns, period
        self.errors: list[str] = []
        self.round_trips = 0
        self.stop = threading.Event()
        with inside(ns):
            self.sock = socket.create_connection(addr, timeout=3)
        self.endpoint = self._line().split()[0]

    def _line(self) -> str:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = self.sock.recv(256)
            if not chunk:
                raise ConnectionError("EOF")
            buf += chunk
        return buf.decode()

    def run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                msg = f"ping {n} {'x' * (n % 97)}\n"
                self.sock.sendall(msg.encode())
                got = self._line()
                if got != msg:
                    self.errors.append(f"round trip {n}: sent {msg!r}, got {got!r}")
                    return
                self.round_trips, n = self.round_trips + 1, n + 1
                self.stop.wait(self.period)
        except OSError as err:
            self.errors.append(f"after {n} round trips: {err!r}")
        finally:
            self.sock.close()


class UdpSession(threading.Thread):
    """One UDP socket connected to `addr` (UDP_VIP:53) querying every `period` s; records which
    endpoint answered (monotonic time, name)."""

    def __init__(self, ns: str, period: float = 0.1, addr: tuple[str, int] = (UDP_VIP, 53)) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.answers: list[tuple[float, str]] = []
        self.losses = 0
        self.stop = threading.Event()
        with inside(ns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(addr)
        self.sock.settimeout(0.5)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            payload = f"q{n}".encode()
            try:
                self.sock.send(payload)
                data = self.sock.recv(2048)
                name, _, echoed = data.split(b"|", 2)
                if echoed == payload:
                    self.answers.append((time.monotonic(), name.decode()))
            except OSError:
                self.losses += 1
            n += 1
            self.stop.wait(self.period)
        self.sock.close()

    def endpoints(self) -> set[str]:
        return {name for _, name in self.answers}


def start_pods(topology: Topology, pods: Pods) -> str:
    for i, ip in enumerate(EPS):
        pods.add(f"be-{i}", ip)
    cli = topology.add_host("cli", "10.244.9.10")
    for ip in EPS:
        wait_listening(cli, ip, 8080)
    return cli


# -- helpers of the transition tests (test_transitions, iptables/test_transitions) ------------
def annotated(objs: list[dict[str, Any]], datapath: str) -> list[dict[str, Any]]:
    """`objs` with every Service annotated usproxy.io/datapath=`datapath`."""
    out = []
    for o in objs:
        if o["kind"] == "Service":
            o = {**o, "metadata": {**o["metadata"], "annotations": {"usproxy.io/datapath": datapath}}}
        out.append(o)
    return out


def talk(cli: str, tcp: int, udp: int, addr: tuple[str, int] = (VIP, 80)) -> tuple[list[TcpTalker], list[UdpSession]]:
    talkers = [TcpTalker(cli, addr=addr) for _ in range(tcp)]
    sessions = [UdpSession(cli) for _ in range(udp)]
    for t in (*talkers, *sessions):
        t.start()
    return talkers, sessions


def finish(talkers: list[TcpTalker], sessions: list[UdpSession]) -> None:
    for stop in [*(t.stop for t in talkers), *(s.stop for s in sessions)]:
        stop.set()
    for t in (*talkers, *sessions):
        t.join(5)


def counts(talkers: list[TcpTalker]) -> list[int]:
    return [t.round_trips for t in talkers]


def kept(talkers: list[TcpTalker], before: list[int], at_least: int) -> None:
    """No talker failed, and each made `at_least` round trips since `before`."""
    assert [t.errors for t in talkers if t.errors] == []
    assert all(t.round_trips - b >= at_least for t, b in zip(talkers, before)), (before, counts(talkers))


def one_endpoint(sessions: list[UdpSession], since: float, at_least: int) -> None:
    """Each UDP session was answered by one endpoint only, `at_least` times after `since`."""
    for s in sessions:
        assert len(s.endpoints()) == 1, f"UDP session moved between endpoints: {s.answers}"
        assert len([a for a in s.answers if a[0] > since]) >= at_least, s.answers
