"""C22 (UDP part): TCP and UDP on the same port number are different services.

Fault class: protocol must be part of every service, flow and NodePort key. A relay that keys
listeners, flows or NodePorts by (address, port) alone sends UDP to the TCP target port, serves
a TCP-only ClusterIP over UDP, or drops the UDP listener when the TCP port of the same number
goes away. Here `dns` has UDP 53→5353 and TCP 53→5354 sharing NodePort 30053; be-a answers UDP
on 5353 as "udp:be-a" and, as a trap, UDP on 5354 as "WRONG"; echo-tcp's pod answers UDP on 7 as
"WRONG" too. 100 UDP queries each to 10.96.0.10:53 and 192.0.2.10:30053 must all come from
udp/5353, echo-udp must echo through its own pod, UDP to the TCP-only echo-tcp ClusterIP must be
refused; then the TCP port is removed from `dns` while UDP queries keep flowing, and UDP must
stay at 100% (during the change and after). The TCP assertions of C22 are in the TCP tests.
No reductions.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import Topology, nsexec
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.udp_helpers import ask, client_socket, start_udpsrv

pytestmark = pytest.mark.netns

DNS_FRONTENDS = (("10.96.0.10", 53), ("192.0.2.10", 30053))


def write(m: Manifests, with_tcp: bool) -> float:
    ports = [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP", "nodePort": 30053}]
    slice_ports = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
    if with_tcp:
        ports.append({"name": "dns-tcp", "port": 53, "targetPort": 5354, "protocol": "TCP", "nodePort": 30053})
        slice_ports.append({"name": "dns-tcp", "port": 5354, "protocol": "TCP"})
    return m.write(
        svc("dns", "10.96.0.10", ports, namespace="kube-system", type="NodePort"),
        slice_("dns", [{"ip": "10.244.1.5", "ready": True}], slice_ports, namespace="kube-system"),
        svc("echo-tcp", "10.96.170.170", [{"port": 7, "targetPort": 7, "protocol": "TCP"}]),
        slice_("echo-tcp", [{"ip": "10.244.2.7", "ready": True}], [{"port": 7, "protocol": "TCP"}]),
        svc("echo-udp", "10.96.170.171", [{"port": 7, "targetPort": 7, "protocol": "UDP"}]),
        slice_("echo-udp", [{"ip": "10.244.3.7", "ready": True}], [{"port": 7, "protocol": "UDP"}]))


def backends_up(topology: Topology, backends: Backends) -> None:
    a = topology.add_host("be-a", "10.244.1.5")
    start_udpsrv(backends, a, "udp:be-a", "10.244.1.5", 5353)
    start_udpsrv(backends, a, "WRONG", "10.244.1.5", 5354)
    backends.start(a, "idsrv", "tcp:be-a", "10.244.1.5", "5354")
    x = topology.add_host("be-x", "10.244.2.7")
    backends.start(x, "echo", "10.244.2.7", "7")
    start_udpsrv(backends, x, "WRONG", "10.244.2.7", 7)
    y = topology.add_host("be-y", "10.244.3.7")
    start_udpsrv(backends, y, "be-y", "10.244.3.7", 7)


def test_udp_keeps_its_own_port(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    backends_up(topology, backends)
    cli = topology.add_host("cli", "10.244.9.10")
    m = Manifests(workdir)
    write(m, with_tcp=True)
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        for dst in DNS_FRONTENDS:
            answers = [ask(cli, dst, b"q%d" % i) for i in range(100)]
            assert answers == [b"udp:be-a|q%d" % i for i in range(100)]
        assert [ask(cli, ("10.96.170.171", 7), b"e%d" % i) for i in range(100)] == \
            [b"be-y|e%d" % i for i in range(100)]
        with pytest.raises(ConnectionRefusedError):
            ask(cli, ("10.96.170.170", 7), b"udp to a TCP-only service")

        # Remove only the TCP port while one connected client per frontend keeps asking.
        socks = [client_socket(cli, connect=dst) for dst in DNS_FRONTENDS]
        try:
            answered = sent = 0
            t_upd = None
            t0 = time.monotonic()
            while time.monotonic() < t0 + 3:
                if t_upd is None and time.monotonic() > t0 + 1:
                    t_upd = write(m, with_tcp=False)
                for s in socks:
                    s.send(b"r%d" % sent)
                    answered += s.recv(65535) == b"udp:be-a|r%d" % sent
                    sent += 1
                time.sleep(0.01)
            assert t_upd is not None
            agent.wait_synced_after(t_upd)
            assert answered == sent
        finally:
            for s in socks:
                s.close()
        for dst in DNS_FRONTENDS:
            assert [ask(cli, dst, b"z%d" % i) for i in range(100)] == [b"udp:be-a|z%d" % i for i in range(100)]
        ports = {(sp["servicePortName"], sp["protocol"]) for sp in agent.services()}
        assert ("kube-system/dns:dns", "UDP") in ports and ("kube-system/dns:dns-tcp", "TCP") not in ports
        assert {"10.96.0.10:53", "192.0.2.10:30053", "192.0.2.11:30053"} <= _udp_sockets(topology)
    finally:
        assert agent.stop() == 0


def test_no_socket_left_on_the_other_protocol(topology: Topology, backends: Backends, workdir: Path,
                                              loop_name: str) -> None:
    """The node holds exactly one UDP socket per UDP frontend, and none for the TCP ones."""
    backends_up(topology, backends)
    m = Manifests(workdir)
    write(m, with_tcp=True)
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        udp = _udp_sockets(topology)
        assert {"10.96.0.10:53", "192.0.2.10:30053", "192.0.2.11:30053", "10.96.170.171:7"} <= udp
        assert "10.96.170.170:7" not in udp
    finally:
        assert agent.stop() == 0


def _udp_sockets(topology: Topology) -> set[str]:
    out = nsexec(topology.node, "ss", "-uanH").stdout.split("\n")
    return {line.split()[3] for line in out if line.strip()}

