"""What runs on the three-node cluster of tests/cluster: NodePort Services and their slices (the
fake API server's bodies), and clients asking the pods, which answer with their name and the peer
they saw (test_three_nodes, test_tc_nodeport, test_tc_dsr, test_xdp_maglev)."""

from __future__ import annotations

import socket
from typing import Any

from tests.netns import inside

def service(name: str, ip: str, node_port: int, etp: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"type": spec.pop("type", "NodePort"), "clusterIP": ip, "clusterIPs": [ip],
                     "externalTrafficPolicy": etp, **spec,
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                                "nodePort": node_port}]}}


def slice_of(service_name: str, pods: list[tuple[str, int]]) -> dict[str, Any]:
    return {"metadata": {"name": f"{service_name}-1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": f"node-{n}"}
                          for ip, n in pods],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


def ask(ns: str, addr: str, port: int, timeout: float = 2.0) -> tuple[str, str]:
    """(pod name, the peer it saw), or ("timeout" | "refused" | "reset", "") (blocking: run it in
    a thread so the API server in this loop keeps serving)."""
    with inside(ns):
        s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        name, peer = s.recv(128).decode().split()[:2]
        return name, peer
    except (TimeoutError, socket.timeout):
        return "timeout", ""
    except ConnectionRefusedError:
        return "refused", ""
    except ConnectionResetError:
        return "reset", ""
    finally:
        s.close()


def udp_service(name: str, ip: str, node_port: int) -> dict[str, Any]:
    svc = service(name, ip, node_port, "Cluster")
    svc["spec"]["ports"] = [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080, "nodePort": node_port}]
    return svc


def udp_slice(name: str, pods: list[tuple[str, int]]) -> dict[str, Any]:
    eps = slice_of(name, pods)
    eps["ports"] = [{"name": "dns", "port": 8080, "protocol": "UDP"}]
    return eps


def connect(ns: str, addr: str, port: int) -> tuple[socket.socket, str, str]:
    with inside(ns):
        s = socket.socket()
    s.settimeout(2.0)
    s.connect((addr, port))
    name, peer = s.recv(128).decode().split()[:2]
    return s, name, peer


def echo(s: socket.socket, text: bytes) -> bytes:
    s.sendall(text)
    return s.recv(len(text))
