"""Field case C22's Services: DNS on TCP and UDP 53 with one NodePort, and TCP and UDP echo
Services on port 7, with the TCP echo client; shared by the relay test (test_c22_tcp_udp_same_port)
and the offload run of the field cases (tests/offload/test_field_cases_offload)."""

from __future__ import annotations

import socket
from typing import Any

from tests.relay.harness import slice_, svc

DNS, ECHO_TCP, ECHO_UDP, NODE = "10.96.0.10", "10.96.170.170", "10.96.170.171", "192.0.2.10"


BE_A, BE_X, BE_Y = "10.244.1.5", "10.244.2.7", "10.244.3.7"


def objects(with_tcp: bool = True) -> list[dict[str, Any]]:
    ports = [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP", "nodePort": 30053}]
    slice_ports = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
    if with_tcp:
        ports.append({"name": "dns-tcp", "port": 53, "targetPort": 5354, "protocol": "TCP", "nodePort": 30053})
        slice_ports.append({"name": "dns-tcp", "port": 5354, "protocol": "TCP"})
    return [
        svc("dns", DNS, ports, namespace="kube-system", type="NodePort"),
        slice_("dns", [{"ip": BE_A, "ready": True}], slice_ports, namespace="kube-system"),
        svc("echo-tcp", ECHO_TCP, [{"port": 7, "targetPort": 7, "protocol": "TCP"}]),
        slice_("echo-tcp", [{"ip": BE_X, "ready": True}], [{"port": 7, "protocol": "TCP"}]),
        svc("echo-udp", ECHO_UDP, [{"port": 7, "targetPort": 7, "protocol": "UDP"}]),
        slice_("echo-udp", [{"ip": BE_Y, "ready": True}], [{"port": 7, "protocol": "UDP"}]),
    ]


def tcp_echo(addr: str, port: int) -> bytes:
    with socket.create_connection((addr, port), timeout=3) as s:
        s.sendall(b"hello")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data
