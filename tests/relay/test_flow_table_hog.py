"""One client fills the shared flow table (issue 18 item 4): fair share and TCP idle timeouts.

Tried: 9,872 idle connections from one client to one Service made every other client of every
other Service get resets, and flows whose backend never closed stayed half-closed for hours.
Now, under pressure (7/8 of the table), a client at its fair share is refused while others are
still admitted (FlowAdmission), and relayed TCP flows idle past kube-proxy's conntrack timeouts
(established: --conntrack-tcp-timeout-established, half-closed: --conntrack-tcp-timeout-close-wait)
are reset on both legs, as the kernel forgets its conntrack entries.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, start_server
from usproxy.flows.flow_table import Flow, FlowTableFull
from usproxy.relay.flow_admission import FlowAdmission
from usproxy.relay.relay import Relay, RelaySettings
from usproxy.relay.tcp import ack_age
from usproxy.model.types import ServicePortName

A = ServicePortName("default", "a", "http", "TCP")
B = ServicePortName("default", "b", "http", "TCP")
FRONTEND = ("10.96.0.1", 80)


def admission(max_flows: int) -> FlowAdmission:
    return FlowAdmission.within(max_flows, 1_000_000, lambda: False)


def test_a_client_at_its_fair_share_is_refused_others_are_not() -> None:
    adm = admission(800)
    hog = []
    with pytest.raises(FlowTableFull, match="fair share"):
        for port in range(1, 10_000):
            hog.append(adm.admit("TCP", A, ("10.0.0.66", port), FRONTEND))
    assert len(hog) == 700  # 7/8 of the table: the pressure mark
    others = [adm.admit("TCP", B, (f"10.0.1.{i}", 40000 + k), FRONTEND) for i in range(10) for k in range(2)]
    assert len(others) == 20 and adm.table.refused == adm.table.refused_fair_share == 1
    # a second heavy client under pressure gets at most the mark shared among the clients
    second = []
    with pytest.raises(FlowTableFull, match="fair share"):
        for port in range(1, 10_000):
            second.append(adm.admit("TCP", B, ("10.0.2.2", port), FRONTEND))
    assert len(second) == 700 // 12  # 12 clients hold flows once it has one
    for f in hog[:400]:
        adm.release(f)  # the hog leaves: no pressure, nobody is limited
    assert adm.admit("TCP", A, ("10.0.0.66", 1), FRONTEND) is not None
    assert adm.table.per_client["10.0.0.66"] == 301


def test_udp_is_never_refused_for_fair_share() -> None:
    """A UDP flood from one client is bounded by eviction of the longest-idle UDP flow (C08), and
    its UDP flows do not count against the same client's TCP share."""
    adm = admission(800)
    for port in range(1, 790):
        adm.admit("UDP", A, ("10.0.0.66", port), FRONTEND)
    assert adm.admit("TCP", B, ("10.0.0.66", 1), FRONTEND) is not None
    assert adm.table.refused_fair_share == 0 and adm.table.per_client == {"10.0.0.66": 1}


def test_a_refused_client_evicts_nobody() -> None:
    """A client over its fair share is refused before any idle UDP flow of another client is
    evicted to make room for it."""
    evicted: list[str] = []

    def evict() -> bool:
        evicted.append("udp")
        return False

    adm = FlowAdmission.within(800, 1_000_000, evict)
    for port in range(1, 701):
        adm.admit("TCP", A, ("10.0.0.66", port), FRONTEND)
    for port in range(1, 101):
        adm.admit("UDP", B, ("10.0.1.1", port), FRONTEND)  # the table is full: 800 of 800
    with pytest.raises(FlowTableFull, match="fair share"):
        adm.admit("TCP", A, ("10.0.0.66", 9999), FRONTEND)
    assert evicted == []


def test_conntrack_max_of_0_leaves_only_the_descriptor_bound() -> None:
    """kube-proxy's rule giving 0 (--conntrack-max-per-core 0 --conntrack-min 0) means no limit of
    its own, not a table of 0 flows that resets every connection."""
    adm = FlowAdmission.within(0, 4096, lambda: False)
    assert adm.descriptors is not None and adm.table.max_flows == adm.descriptors // 2 > 1000
    assert adm.admit("TCP", A, ("10.0.0.1", 1), FRONTEND) is not None


def test_no_client_is_limited_without_pressure() -> None:
    adm = admission(800)
    flows = [adm.admit("TCP", A, ("10.0.0.66", port), FRONTEND) for port in range(1, 700)]
    assert len(flows) == 699 and adm.table.refused == 0


def settings(established: float, close_wait: float) -> RelaySettings:
    return RelaySettings("usproxy-test0", "roundRobin", 1000, 30.0, established, close_wait)


def test_idle_and_half_closed_flows_are_reset_after_their_timeouts() -> None:
    relay = Relay.__new__(Relay)  # only the flow table and the settings: no interface, no loop
    relay.settings = settings(100.0, 10.0)
    relay.admission = admission(1000)
    closed: list[str] = []

    def flow(name: str, state: str, idle: float, protocol: str = "TCP") -> Flow:
        f = relay.admission.admit(protocol, A, (f"10.0.0.{len(closed) + 1}", 1), FRONTEND)
        f.state = state  # type: ignore[assignment]
        f.last_seen = 1000.0 - idle
        f.closer = lambda: closed.append(name)
        return f

    flow("busy", "ESTABLISHED", 99.0)
    flow("idle", "ESTABLISHED", 101.0)
    flow("half-busy", "FIN_WAIT", 9.0)
    flow("half-idle", "FIN_WAIT", 11.0)
    flow("dialing", "SYN_SENT", 500.0)  # the dial's own timeouts end it
    flow("udp", "ASSURED", 500.0, "UDP")  # UDP has its own idle timeout
    kept = flow("kept-alive", "ESTABLISHED", 500.0)  # keepalive probes answered 3 s ago
    kept.liveness = lambda: 3.0
    assert relay.expire_tcp(now=1000.0) == 2
    assert sorted(closed) == ["half-idle", "idle"] and relay.admission.table.timed_out == 2
    assert kept.last_seen == 997.0  # its activity moved up to the last ACK
    relay.settings = settings(0.0, 0.0)  # 0 turns a timeout off
    closed.clear()
    assert relay.expire_tcp(now=10_000.0) == 0 and closed == []


def test_ack_age_sees_keepalive_answers_on_an_idle_connection() -> None:
    """TCP_INFO's last ACK received moves with keepalive probes while no payload flows: what keeps
    a kernel conntrack entry alive keeps a relayed flow alive too (loopback, keepalive every 0.5 s)."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    try:
        idle = socket.create_connection(srv.getsockname())
        idle_peer, _ = srv.accept()
        cli.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        time.sleep(2.6)

        class T:
            def __init__(self, s: socket.socket) -> None:
                self.s = s

            def get_extra_info(self, name: str) -> object:
                return self.s

        alive, silent = ack_age(T(cli)), ack_age(T(idle))  # type: ignore[arg-type]
        assert alive is not None and silent is not None
        assert alive < 1.5 <= 2.4 <= silent, (alive, silent)
        idle.close()
        idle_peer.close()
    finally:
        for s in (cli, peer, srv):
            s.close()


VIP_A, VIP_B, VIP_C, BE = "10.96.70.1", "10.96.70.2", "10.96.70.3", "10.244.1.70"
TCP_PORT = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def objects() -> list[dict[str, object]]:
    port = [{"name": "http", "port": 80, "targetPort": 8080}]
    slow = [{"name": "http", "port": 80, "targetPort": 9000}]
    return [svc("a", VIP_A, port), slice_("a", [{"ip": BE, "ready": True}], TCP_PORT),
            svc("b", VIP_B, port), slice_("b", [{"ip": BE, "ready": True}], TCP_PORT, name="b-abc"),
            svc("c", VIP_C, slow), slice_("c", [{"ip": BE, "ready": True}],
                                          [{"name": "http", "port": 9000, "protocol": "TCP"}], name="c-abc")]


@pytest.fixture
def relay_of_64(topology: Topology, backends: Backends, workdir: Path) -> Iterator[AgentProc]:
    """A relay whose table holds 64 flows and resets half-closed flows idle for 1 s; Service c's
    endpoint reads to EOF, then stays silent for 30 s before answering (a backend that never
    closes, as far as the timeout is concerned)."""
    be = topology.add_host("be", BE)
    backends.start(be, "idsrv", "be", BE, "8080")
    start_server(backends, be, "eofsrv", BE, "9000", "--order", "client-first", "--delay", "30")
    m = Manifests(workdir)
    m.write(*objects())
    agent = AgentProc(topology, m, "uvloop", "--conntrack-max-per-core", "0", "--conntrack-min", "64",
                      "--conntrack-tcp-timeout-close-wait", "1s")
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def test_one_client_cannot_lock_out_the_others(topology: Topology, relay_of_64: AgentProc) -> None:
    """One client opens idle connections to Service a until it is refused; a client of Service b,
    and a new client of a, are still served."""
    hog_ns = topology.add_host("hog", "10.244.9.66")
    cli = topology.add_host("cli", "10.244.9.10")
    held: list[socket.socket] = []
    try:
        refused = False
        for _ in range(80):
            try:
                with inside(hog_ns):
                    s = socket.create_connection((VIP_A, 80), timeout=3)
            except ConnectionResetError:
                refused = True  # the refusal's reset came before connect() returned (a loaded machine)
                break
            try:
                if s.recv(64):
                    held.append(s)
                    continue
            except ConnectionResetError:
                pass
            s.close()
            refused = True
            break
        assert refused and len(held) == 56  # its fair share is the whole 7/8 mark
        with inside(cli):
            for vip in (VIP_B, VIP_A, VIP_B):
                got = attempt(vip, 80)
                assert (got.kind, got.name) == ("ok", "be"), (vip, got)
    finally:
        for s in held:
            s.close()


def test_half_closed_flows_are_reset_after_the_close_wait_timeout(topology: Topology, relay_of_64: AgentProc) -> None:
    cli = topology.add_host("cli", "10.244.9.10")
    conns = []
    for _ in range(5):
        with inside(cli):
            s = socket.create_connection((VIP_C, 80), timeout=3)
        s.sendall(b"request")
        s.shutdown(socket.SHUT_WR)  # relayed as FIN; the endpoint then stays silent
        conns.append(s)
    time.sleep(0.3)
    assert sum(f["state"] == "FIN_WAIT" for f in relay_of_64.flows()) == 5, relay_of_64.flows()
    t0 = time.monotonic()
    for s in conns:
        s.settimeout(5)
        with pytest.raises(ConnectionResetError):
            while s.recv(64):
                pass
        s.close()
    assert 0.5 <= time.monotonic() - t0 <= 3.0  # reset about 1 s after the last byte, not at 30 s
    assert relay_of_64.flows() == []


def test_deferred_set_up_runs_once_per_live_tcp_flow() -> None:
    relay = Relay.__new__(Relay)  # only the flow table: no interface, no loop
    relay.admission = admission(1000)
    ran: list[int] = []
    for i in range(3):
        f = relay.admission.admit("TCP", A, (f"10.0.0.{i + 1}", 1), FRONTEND)
        f.settle = lambda i=i: ran.append(i)
    relay.admission.admit("TCP", A, ("10.0.0.9", 1), FRONTEND)  # nothing deferred
    assert relay.settle_tcp() == 3 and sorted(ran) == [0, 1, 2]
    assert relay.settle_tcp() == 0 and len(ran) == 3
