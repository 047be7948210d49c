"""The real agent (relay + nftables offload) in a throwaway node namespace: offload after the
window with a client connecting throughout (no failure, the relay's flow count stays flat, kernel
flows in /flows), demotion on an injected kernel failure back to the relay (no failure), an agent
restart with traffic flowing (C20: table neither flushed nor rebuilt), C01 and C03 in offload
mode, a relay listener error shown in /services while offload establishes, and `usproxy run
--cleanup`."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.agent import VIP, metric, placement, wait_for, web
from tests.offload.harness import Pods, nft_list, tcp_peer_name, udp_socket, wait_listening
from tests.relay.harness import USPROXY, AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns


class Prober:
    """Connects to VIP:80 from `ns` continuously, recording failures and who answered."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.failures: list[str] = []
        self.answers: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                name, peer = tcp_peer_name(self.ns, VIP, 80)
                self.answers.append((time.monotonic(), name, peer))
            except OSError as err:
                self.failures.append(repr(err))
            time.sleep(0.01)


def test_offload_handover_and_demotion_without_a_failed_connection(topology: Topology, tmp_path: Path, pods: Pods,
                                                                   agent_factory: Any) -> None:
    pods.add("be-a", "10.244.1.5")
    pods.add("be-b", "10.244.2.5")
    pods.add("be-c", "10.244.3.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.3.5", 8080)
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5", "10.244.2.5"]))
    agent = agent_factory(m)
    agent.start()  # the relay serves from the first sync; the prober runs from then on
    assert placement(agent)[1].startswith("establishing")
    with Prober(cli) as prober:
        wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
        assert placement(agent)[1].startswith("established")
        relayed = metric(agent, "usproxy_flows_total", 'protocol="TCP"')
        t_off = time.monotonic()
        wait_for(lambda: len([a for a in prober.answers if a[0] > t_off]) >= 50, what="traffic after offload")
        # new connections take the kernel path: the relay's flow count stays flat and the
        # endpoints see the client's own address (DNAT, no proxy in between)
        assert metric(agent, "usproxy_flows_total", 'protocol="TCP"') == relayed
        assert {peer for t, _, peer in prober.answers if t > t_off + 0.2} == {"10.244.9.10"}
        # a long-lived connection shows in /flows as a kernel flow
        with inside(cli):
            held = socket.create_connection((VIP, 80), timeout=3)
        held.recv(64)
        rows = [f for f in agent.flows() if f["datapath"] == "nftables"]
        assert any(f["original"]["src"].startswith("10.244.9.10:") and f["service"] == "default/web:http/TCP"
                   for f in rows)
        held.close()
        # demotion: the table is damaged behind the agent's back, the next update is refused
        nsexec(topology.node, "nft", "flush", "map", "ip", "usproxy", "slot-1")
        m.write(*web(["10.244.1.5", "10.244.3.5"]))  # replaces the slot-1 element: refused
        wait_for(lambda: placement(agent)[1].startswith("demoted:"), what="demotion")
        assert metric(agent, "usproxy_offload_demotions_total", 'datapath="nftables",reason="apply_failed"') == 1
        t_dem = time.monotonic()
        wait_for(lambda: len([a for a in prober.answers if a[0] > t_dem]) >= 30, what="traffic after demotion")
        assert metric(agent, "usproxy_flows_total", 'protocol="TCP"') > relayed  # the relay serves again
    assert prober.failures == []
    assert len(prober.answers) > 100


def test_restart_keeps_offloaded_traffic_and_the_table(topology: Topology, tmp_path: Path, pods: Pods,
                                                        agent_factory: Any) -> None:
    pods.add("be-a", "10.244.1.50")
    pods.add("be-b", "10.244.2.50")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.2.50", 8080)
    m = Manifests(tmp_path / "m")
    udp_ports = [{"name": "u", "port": 4433, "targetPort": 8080, "protocol": "UDP"}]
    m.write(*web(["10.244.1.50", "10.244.2.50"]),
            svc("quic", "10.96.10.11", udp_ports),
            slice_("quic", [{"ip": "10.244.1.50", "ready": True}, {"ip": "10.244.2.50", "ready": True}],
                   [{"name": "u", "port": 8080, "protocol": "UDP"}]))
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent)[0] == placement(agent, "default/quic:u")[0] == "nftables", what="offload")
    with inside(cli):
        held = socket.create_connection((VIP, 80), timeout=3)
    held.settimeout(3)
    held.recv(64)
    sessions = [udp_socket(cli, ("10.244.9.10", 42000 + i)) for i in range(5)]
    for s in sessions:
        s.settimeout(2)
        s.connect(("10.96.10.11", 4433))

    def backends() -> list[bytes]:
        out = []
        for s in sessions:
            s.send(b"q")
            out.append(s.recv(512).split(b"|")[0])
        return out

    before_udp = backends()
    table = nft_list(topology.node)
    with Prober(cli) as prober:
        time.sleep(0.3)
        agent.stop()
        assert nft_list(topology.node) == table  # not flushed on exit
        time.sleep(1)
        assert backends() == before_udp  # kernel keeps serving while no agent runs
        agent.start()
        wait_for(lambda: placement(agent)[0] == "nftables", what="adopted")
        assert placement(agent)[1].startswith("established")
        time.sleep(0.5)
    assert nft_list(topology.node) == table  # reconciled as a diff: nothing changed
    assert prober.failures == [] and len(prober.answers) > 20
    held.sendall(b"still here")
    assert held.recv(64) == b"still here"
    assert backends() == before_udp
    held.close()
    for s in sessions:
        s.close()


def test_offload_none_removes_the_tables_an_nftables_run_left(topology: Topology, tmp_path: Path, pods: Pods,
                                                                agent_factory: Any) -> None:
    """An agent with --offload none over an earlier nftables run's tables removes them (as
    kube-proxy's platformCleanup) and logs it; the relay then serves new connections."""
    pods.add("be-a", "10.244.1.50")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.50", 8080)
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.50"]))
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
    agent.stop()
    assert "table ip usproxy" in nft_list(topology.node)  # left on exit, as today
    relay_only = AgentProc(topology, m, "uvloop", "--offload", "none")
    try:
        relay_only.start()
        assert "table ip usproxy {" not in nft_list(topology.node)  # (the relay's usproxy-return stays)
        assert "table ip6 usproxy {" not in nft_list(topology.node)
        assert placement(relay_only)[0] == "userspace"
        with inside(cli):
            held = socket.create_connection((VIP, 80), timeout=3)
        held.settimeout(3)
        assert held.recv(64).startswith(b"be-a")
        wait_for(lambda: [f["datapath"] for f in relay_only.flows()] == ["userspace"], what="a relayed flow")
        held.close()
    finally:
        relay_only.stop()
    log = relay_only.log.read_text()
    assert "removed nftables table ip usproxy: left by an earlier run with another --offload" in log


def test_c01_refused_while_empty_in_offload_mode(topology: Topology, tmp_path: Path, pods: Pods,
                                                 agent_factory: Any) -> None:
    pods.add("be-a", "10.244.1.5")
    cli = topology.add_host("cli", "10.244.9.10")
    wait_listening(cli, "10.244.1.5", 8080)
    m = Manifests(tmp_path / "m")
    np = {"type": "NodePort", "port_extra": {"nodePort": 30080}}
    m.write(*web([], **np))
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
    for addr, port in ((VIP, 80), ("192.0.2.10", 30080)):
        for _ in range(50):
            with pytest.raises(ConnectionRefusedError):
                tcp_peer_name(cli, addr, port)
    t_upd = m.write(*web(["10.244.1.5"], **np))
    agent.wait_synced_after(t_upd)
    assert {tcp_peer_name(cli, a, p)[0] for a, p in ((VIP, 80), ("192.0.2.10", 30080)) for _ in range(50)} == {"be-a"}
    t_upd = m.write(*web([], **np))
    agent.wait_synced_after(t_upd)
    for _ in range(20):
        with pytest.raises(ConnectionRefusedError):
            tcp_peer_name(cli, VIP, 80)
    assert placement(agent)[0] == "nftables"


def test_c03_udp_in_offload_mode(topology: Topology, tmp_path: Path, pods: Pods, agent_factory: Any) -> None:
    pods.add("be-a", "10.244.1.7", port=8125, mute=True)
    pods.add("be-b", "10.244.2.8", port=8125, mute=True)
    cli = topology.add_host("cli", "10.244.9.10")
    nsexec(topology.node, "sysctl", "-qw", "net.ipv4.icmp_ratelimit=0")  # count every refusal
    m = Manifests(tmp_path / "m")
    ports = [{"port": 8125, "targetPort": 8125, "protocol": "UDP"}]

    def statsd(*ips: str) -> list[dict[str, Any]]:
        return [svc("statsd", "10.96.20.20", ports, namespace="monitoring"),
                slice_("statsd", [{"ip": i, "ready": True} for i in ips], [{"port": 8125, "protocol": "UDP"}],
                       namespace="monitoring")]

    m.write(*statsd())
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent, "monitoring/statsd")[0] == "nftables", what="offload")
    s = udp_socket(cli, ("10.244.9.10", 41000))
    s.connect(("10.96.20.20", 8125))
    s.settimeout(0.05)

    def send(seconds: float) -> int:
        refused, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                s.send(b"m:1|c")
                s.recv(64)
            except ConnectionRefusedError:
                refused += 1
            except TimeoutError:
                pass
        return refused

    assert send(1.0) >= 15  # ~20 sends/s, refused
    agent.wait_synced_after(m.write(*statsd("10.244.1.7")))
    send(0.5)
    a0 = pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0)
    send(1.0)
    time.sleep(0.2)
    assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) - a0 >= 15
    agent.wait_synced_after(m.write(*statsd()))
    send(0.5)
    a1 = pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0)
    assert send(1.0) >= 15
    agent.wait_synced_after(m.write(*statsd("10.244.2.8")))
    send(0.5)
    b0 = pods.counts("be-b", "udp", 8125).get("10.244.2.8", 0)
    send(1.0)
    time.sleep(0.2)
    assert pods.counts("be-b", "udp", 8125).get("10.244.2.8", 0) - b0 >= 15
    assert pods.counts("be-a", "udp", 8125).get("10.244.1.7", 0) == a1
    s.close()


def test_relay_listener_error_shows_while_offload_establishes(topology: Topology, tmp_path: Path,
                                                              pods: Pods) -> None:
    """A NodePort address taken by another process: /services says so (it used to say
    "establishing: 0.0s of 5.0s" once offload was on)."""
    pods.add("be-a", "10.244.1.5")
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"], type="NodePort", port_extra={"nodePort": 30080}))
    with inside(topology.node):
        squatter = socket.socket()
    squatter.bind(("192.0.2.10", 30080))
    squatter.listen()
    # --relay-capture none: with a capture (the default) the held NodePort is served through it
    # (tests/relay/test_node_daemon_owns_a_service_port.py); the error shows where none works
    agent = AgentProc(topology, m, "uvloop", "--offload", "nftables", "--offload-after", "60",
                      "--relay-capture", "none")
    try:
        agent.start()
        wait_for(lambda: "address already in use" in placement(agent)[1].lower(), what="the listener error")
        where, why = placement(agent)  # the words after the address are the event loop's (uvloop here)
        assert where == "userspace" and why.startswith("listen 192.0.2.10:30080: ")
    finally:
        agent.stop()
        squatter.close()


def test_cleanup_removes_the_table(topology: Topology, tmp_path: Path, pods: Pods, agent_factory: Any) -> None:
    pods.add("be-a", "10.244.1.5")
    m = Manifests(tmp_path / "m")
    m.write(*web(["10.244.1.5"]))
    agent = agent_factory(m)
    agent.start()
    wait_for(lambda: placement(agent)[0] == "nftables", what="offload")
    agent.stop()
    assert "table ip usproxy" in nft_list(topology.node)
    res = nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
    assert res.returncode == 0, res.stderr
    assert "usproxy" not in nft_list(topology.node)
