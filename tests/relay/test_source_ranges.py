"""loadBalancerSourceRanges in the relay (`--offload none`), with real traffic on both event loops.

A client inside the ranges reaches the pod through the LB IP; one outside gets no answer (its TCP
SYN and its datagrams are dropped by the listener's socket filter: a timeout, not a refusal, as
kube-proxy's DROP) and no flow is ever opened for it; the NodePort of the same Service serves the
blocked client (kube-proxy: "nodePort bypasses LoadBalancerSourceRanges"). Changing the ranges in
the manifest moves the filter without reopening the listener. Clients use documentation
addresses, in a namespace of their own."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec
from tests.offload.harness import Pods, tcp_name, udp_socket, wait_listening
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

LB_IP, NODE_IP = "198.51.100.1", "192.0.2.10"
ALLOWED, BLOCKED = "203.0.113.2", "203.0.113.130"


def manifests(ranges: list[str]) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080},
             {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP", "nodePort": 30053}]
    web = svc("web", "10.96.10.10", ports, type="LoadBalancer", loadBalancerSourceRanges=ranges)
    web["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}, {"ip": "198.51.100.9", "ipMode": "Proxy"}]}}
    eps = slice_("web", [{"ip": "10.244.1.5", "ready": True}],
                 [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 8080, "protocol": "UDP"}])
    return [web, eps]


def connect_outcome(ns: str, addr: str, port: int, src: str) -> str:
    try:
        return tcp_name(ns, addr, port, timeout=1.5, src=src)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except OSError as err:  # e.g. unreachable: the node has no use for the address
        return err.strerror or "error"


def udp_answer(ns: str, addr: str, port: int, src: str) -> bytes:
    s = udp_socket(ns, (src, 0))
    s.settimeout(1.0)
    try:
        s.sendto(b"q", (addr, port))
        return s.recv(512)
    except socket.timeout:
        return b""
    finally:
        s.close()


def test_relay_drops_clients_outside_the_ranges_at_the_lb_ip_only(topology: Topology, tmp_path: Path,
                                                                   loop_name: str) -> None:
    pods = Pods(topology, tmp_path)
    m = Manifests(tmp_path / "m")
    m.write(*manifests([" 203.0.113.0/25"]))  # whitespace trimmed, as kube-proxy
    agent = AgentProc(topology, m, loop_name)
    try:
        pods.add("be-a", "10.244.1.5")
        cli = topology.add_host("ext", "10.244.9.30", ALLOWED, BLOCKED)
        nsexec(topology.node, "ip", "route", "add", "203.0.113.0/24", "via", "10.244.9.30")
        wait_listening(cli, "10.244.1.5", 8080)
        agent.start()
        assert connect_outcome(cli, LB_IP, 80, ALLOWED) == "be-a"
        assert connect_outcome(cli, LB_IP, 80, BLOCKED) == "timeout"  # no handshake: DROP
        assert connect_outcome(cli, NODE_IP, 30080, BLOCKED) == "be-a"  # the NodePort is not filtered
        assert udp_answer(cli, LB_IP, 53, ALLOWED).startswith(b"be-a|")
        assert udp_answer(cli, LB_IP, 53, BLOCKED) == b""
        assert udp_answer(cli, NODE_IP, 30053, BLOCKED).startswith(b"be-a|")
        to_lb = [f["original"]["src"] for f in agent.flows() if f["original"]["dst"].startswith(LB_IP + ":")]
        assert any(src.startswith(ALLOWED + ":") for src in to_lb)  # the UDP flow of the allowed client
        assert not any(src.startswith(BLOCKED + ":") for src in to_lb)  # none ever for the blocked one
        # an ingress with ipMode Proxy is not served here (kube-proxy: not a VIP)
        assert connect_outcome(cli, "198.51.100.9", 80, ALLOWED) != "be-a"
        agent.wait_synced_after(m.write(*manifests(["203.0.113.128/25"])))
        assert connect_outcome(cli, LB_IP, 80, BLOCKED) == "be-a"
        assert connect_outcome(cli, LB_IP, 80, ALLOWED) == "timeout"
        agent.wait_synced_after(m.write(*manifests([])))
        assert connect_outcome(cli, LB_IP, 80, ALLOWED) == "be-a"
        assert udp_answer(cli, LB_IP, 53, BLOCKED).startswith(b"be-a|")
    finally:
        agent.stop()
        pods.close()
