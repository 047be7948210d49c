"""C23 (UDP parts, and mixed-family input): IPv6 Services through the relay.

Fault class: address-family handling: parsing and formatting host:port (an IPv6 address has
colons of its own), per-family sockets and tables, the IPv6 maximum datagram size (65,527, 20
bytes more than IPv4's), and input that mixes families in one Service. Covered here:
- a connected UDP client asking 10 times/s keeps being answered while the endpoint its flow uses
  is removed: from 1 s after the update every query is answered by the remaining endpoint, and
  the agent does not crash;
- one 65,527-byte datagram reaches the endpoint intact (the endpoint reports its sha256) and
  the answer comes back whole;
- `v6-bad` (an IPv6 Service with an IPv4 external IP) is loaded: the IPv4 address is logged and
  skipped, while its ClusterIP and `v6` keep working at 100%;
- /flows and /services and the logs write IPv6 endpoints as bracketed `[addr]:port`;
- ICMP port unreachable from an endpoint (its server gone for a moment) is logged for that flow
  and is transient: the same client flow is answered again once the server is back.
The 1,000-connection TCP split of C23 is in the TCP tests; `v6-bad`'s ClusterIP is checked here
with 20 TCP connections. The node and hosts get IPv6 from tests/netns6.py.
Reductions: the UDP client runs for 3 s around the removal instead of indefinitely.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.netns6 import add_address6, enable_ipv6
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.udp_helpers import client_socket, start_udpsrv, udp_flows

pytestmark = pytest.mark.netns

EPS = {"be1": "2001:db8:244:1::5", "be2": "2001:db8:244:2::6", "be3": "2001:db8:244:3::7"}
CLIENT6 = "2001:db8:244:9::10"
V6_DNS = ("2001:db8:96::a", 53)
V6_BAD = ("2001:db8:96::b", 80)


def write(m: Manifests, v6_eps: list[str]) -> float:
    v6_ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}]
    return m.write(
        svc("v6", V6_DNS[0], v6_ports, ipFamilies=["IPv6"]),
        slice_("v6", [{"ip": EPS[n], "ready": True} for n in v6_eps],
               [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"}],
               address_type="IPv6"),
        svc("v6-bad", V6_BAD[0], [{"port": 80, "targetPort": 8080, "protocol": "TCP"}], ipFamilies=["IPv6"],
            externalIPs=["192.0.2.50"]),
        slice_("v6-bad", [{"ip": EPS["be3"], "ready": True}], [{"port": 8080, "protocol": "TCP"}],
               address_type="IPv6"))


def setup_hosts(topology: Topology, backends: Backends) -> tuple[str, dict[str, subprocess.Popen[bytes]]]:
    """The pods (TCP idsrv on 8080, udpsrv on 53) and the client; returns it and the udpsrvs."""
    enable_ipv6(topology)
    udpsrvs = {}
    for i, (name, ip) in enumerate(EPS.items()):
        ns = topology.add_host(name, f"10.244.{i + 1}.5")
        add_address6(ns, ip)
        backends.start(ns, "idsrv", name, ip, "8080")
        udpsrvs[name] = start_udpsrv(backends, ns, name, ip, 53)
    cli = topology.add_host("cli", "10.244.9.10")
    add_address6(cli, CLIENT6)
    return cli, udpsrvs


def endpoint_refuses_for_a_while(topology: Topology, backends: Backends, cli: str, name: str,
                                 udpsrv: subprocess.Popen[bytes]) -> None:
    """The endpoint's UDP server goes away (its kernel answers ICMP port unreachable to the
    relay's flow socket) and comes back: the same client flow is answered again, nothing else."""
    backends.stop(udpsrv)
    with client_socket(cli, socket.AF_INET6, connect=V6_DNS, timeout=0.2) as s:
        for i in range(5):
            s.send(b"gone%d" % i)
            with pytest.raises(TimeoutError):
                s.recv(65535)
        start_udpsrv(backends, topology.ns(name), name, EPS[name], 53)
        s.settimeout(2)
        s.send(b"back")
        assert s.recv(65535) == b"%s|back" % name.encode()


def tcp_name(ns: str, dst: tuple[str, int]) -> str:
    with inside(ns):
        s = socket.create_connection(dst, timeout=3)
    with s:
        return s.makefile().readline().strip()


def stream_across_removal(cli: str, m: Manifests) -> tuple[list[tuple[float, bytes | None]], float, str]:
    """Ask 10 times/s for 4 s, each question answered before the next is sent (up to 2 s: a
    loaded machine delays answers, and a late one must not be taken for the next question's);
    at the 11th, remove the endpoint that has been answering. Each answer is stamped with the
    time its question was sent."""
    answers: list[tuple[float, bytes | None]] = []
    removed = ""
    t_upd = 0.0
    with client_socket(cli, socket.AF_INET6, connect=V6_DNS, timeout=2.0) as s:
        t0 = time.monotonic()
        for i in range(40):
            time.sleep(max(0.0, t0 + i / 10 - time.monotonic()))
            if i == 10:
                removed = answers[-1][1].split(b"|")[0].decode() if answers[-1][1] else "?"
                t_upd = write(m, [n for n in ("be1", "be2") if n != removed])
            at = time.monotonic()
            s.send(b"q%d" % i)
            try:
                answers.append((at, s.recv(65535)))
            except (TimeoutError, ConnectionRefusedError):
                answers.append((at, None))
    return answers, t_upd, removed


def test_ipv6_udp_and_mixed_family(topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    cli, udpsrvs = setup_hosts(topology, backends)
    m = Manifests(workdir)
    write(m, ["be1", "be2"])
    agent = AgentProc(topology, m, loop_name)
    try:
        agent.start()
        answers, t_upd, removed = stream_across_removal(cli, m)
        assert removed in ("be1", "be2")
        before = [a for at, a in answers if at < t_upd]
        assert all(a is not None and a.startswith(removed.encode() + b"|") for a in before)
        after = [a for at, a in answers if at >= t_upd + 1.5]
        kept = ({"be1", "be2"} - {removed}).pop()
        assert after and all(a is not None and a.startswith(kept.encode() + b"|") for a in after), after
        assert agent.get("/healthz", port=10256) is not None

        flows = udp_flows(agent)
        assert flows and all(f["original"]["dst"] == "[2001:db8:96::a]:53" for f in flows)
        assert all(f["original"]["src"].startswith(f"[{CLIENT6}]:") for f in flows)
        assert {f["endpoint"] for f in flows} == {f"[{EPS[kept]}]:53"}

        big = os.urandom(65527)
        with client_socket(cli, socket.AF_INET6, connect=V6_DNS) as s:
            s.send(big)
            reply = s.recv(1 << 17)
        assert reply == b"%s|len=65527|sha256=%s" % (kept.encode(), hashlib.sha256(big).hexdigest().encode())

        log = agent.log.read_text()
        assert "192.0.2.50" in log and "skipped" in log
        assert [tcp_name(cli, V6_BAD) for _ in range(20)] == ["be3"] * 20
        with client_socket(cli, socket.AF_INET6, connect=V6_DNS) as s:
            for i in range(100):
                s.send(b"z%d" % i)
                assert s.recv(65535) == b"%s|z%d" % (kept.encode(), i)
        bad = [sp for sp in agent.services() if sp["servicePortName"] == "default/v6-bad"]
        assert bad and bad[0]["externalIPs"] == []
        v6 = [sp for sp in agent.services() if sp["servicePortName"] == "default/v6:dns"]
        assert [e["address"] for e in v6[0]["endpoints"]] == [f"[{EPS[kept]}]:53"]

        endpoint_refuses_for_a_while(topology, backends, cli, kept, udpsrvs[kept])
        assert f"default/v6:dns: endpoint [{EPS[kept]}]:53: [Errno 111] Connection refused" in agent.log.read_text()
    finally:
        assert agent.stop() == 0
