"""Live flows across the relay -> nftables handover: long-lived TCP connections and UDP sessions
that keep talking while their ServicePort is offloaded, on a fresh node (no usproxy table before
the first offload) and on a warm one (the table already serves another Service).

What must hold (README, "Kernel offload": live flows at each transition): a connection the relay owns is never
translated by the kernel datapath, whatever the order of events, so every TCP talker keeps its
connection and every echo comes back intact; a UDP session relayed before the offload keeps its
endpoint after it. New connections after the offload take the kernel path.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.harness import Pods, tcp_peer_name, wait_listening
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

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


def placement(agent: AgentProc, name: str) -> str:
    return next((str(r["datapath"]) for r in agent.services() if r["servicePortName"] == name), "absent")


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def start_pods(topology: Topology, pods: Pods) -> str:
    for i, ip in enumerate(EPS):
        pods.add(f"be-{i}", ip)
    cli = topology.add_host("cli", "10.244.9.10")
    for ip in EPS:
        wait_listening(cli, ip, 8080)
    return cli


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("node", ["fresh", "warm"])
def test_relayed_flows_survive_the_offload(topology: Topology, tmp_path: Path, pods: Pods, loop: str,
                                           node: str) -> None:
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = AgentProc(topology, m, loop, "--offload", "nftables", "--offload-after", "3",
                      "--min-sync-period", "200ms")
    try:
        if node == "warm":  # the table exists and serves `other` before web and dns are known
            m.write(*services(other=True)[4:])
            agent.start()
            wait_for(lambda: placement(agent, "default/other:http") == "nftables", 15, "other offloaded")
            m.write(*services(other=True))
            wait_for(lambda: placement(agent, "default/web:http") == "userspace", 5, "web relayed")
        else:
            m.write(*services())
            agent.start()
        assert placement(agent, "default/web:http") == "userspace"
        talkers = [TcpTalker(cli) for _ in range(16)]
        sessions = [UdpSession(cli) for _ in range(6)]
        for t in (*talkers, *sessions):
            t.start()
        wait_for(lambda: placement(agent, "default/web:http") == "nftables"
                 and placement(agent, "default/dns:dns") == "nftables", 15, "offload")
        t_off = time.monotonic()
        time.sleep(3)  # every talker makes about 12 more round trips over the kernel-era table
        # new connections now take the kernel path: the endpoint sees the client's own address
        assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"
        for t in (*talkers, *sessions):
            t.stop.set()
        for t in (*talkers, *sessions):
            t.join(5)
        assert [t.errors for t in talkers if t.errors] == []
        assert all(t.round_trips >= 12 for t in talkers), [t.round_trips for t in talkers]
        for s in sessions:
            assert len(s.endpoints()) == 1, f"UDP session moved between endpoints: {s.answers}"
            assert len([a for a in s.answers if a[0] > t_off]) >= 20
        # the relay still owns the relayed flows until they close: they are listed as its flows
    finally:
        agent.stop()


def test_a_relayed_connection_picked_up_mid_stream_is_not_translated(topology: Topology, tmp_path: Path,
                                                                      pods: Pods) -> None:
    """The relay's connections lose their conntrack entries after the offload (as when an entry
    expires under a long-idle connection, or `conntrack -F`): with nf_conntrack_tcp_loose the next
    segment starts a new entry mid-stream, and only a SYN may be DNATed, so the relay keeps them."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    m.write(*services()[:2])
    agent = AgentProc(topology, m, "uvloop", "--offload", "nftables", "--offload-after", "4",
                      "--min-sync-period", "200ms")
    try:
        agent.start()
        talkers = [TcpTalker(cli, period=0.1) for _ in range(4)]
        # the premise: all four connected through the relay (on a loaded CI machine one once
        # connected after the offload: a kernel flow whose entry is deleted is lost, as expected)
        assert placement(agent, "default/web:http") == "userspace", "talkers connected after the offload"
        for t in talkers:
            t.start()
        wait_for(lambda: placement(agent, "default/web:http") == "nftables", 15, "offload")
        assert nsexec(topology.node, "sysctl", "-n", "net.netfilter.nf_conntrack_tcp_loose").stdout.strip() == "1"
        nsexec(topology.node, "conntrack", "-D", "-p", "tcp", "--orig-dst", VIP, check=False)
        time.sleep(2)
        # the talkers' entries, re-created mid-stream by whichever segment came first: the client's
        # (original direction to the VIP) or, on a loaded machine, the relay's echo or ACK (original
        # direction from the VIP)
        picked_up = "".join(nsexec(topology.node, "conntrack", "-L", "-p", "tcp", way, VIP, check=False).stdout
                            for way in ("--orig-dst", "--orig-src"))
        assert picked_up.count("ESTABLISHED") >= 4, picked_up
        for t in talkers:
            t.stop.set()
        for t in talkers:
            t.join(5)
        assert [t.errors for t in talkers if t.errors] == []
        assert all(t.round_trips >= 30 for t in talkers), [t.round_trips for t in talkers]
    finally:
        agent.stop()
