"""Why the relay's one difference from kube-proxy's packet flows cannot be closed: every endpoint
sees a node address ("masqueraded") where kube-proxy keeps the client's.

kube-proxy keeps a pod client's address by rewriting only the destination (DNAT) in the kernel:
the endpoint's answer goes back to the client's address, and conntrack on the node, which routes
it (the pod's gateway), undoes the DNAT. The relay terminates the client's connection and opens its
own to the endpoint. To keep the client's address it would have to open that second connection
from the client's address (IP_TRANSPARENT and bind(), as a transparent proxy does). Then the
endpoint answers the client's address by its own routing: a client on the same pod network gets
the endpoint's SYN-ACK directly, not through the node, knows no such connection and resets it;
the relay's connection never completes. Bringing the answer back to the relay needs kernel NAT or
policy routing by packet marks (TPROXY's `-m socket` and `fwmark` rules), which is what a node
that runs only the relay lacks. Here, in network namespaces: the same dial from the node
succeeds with the node's own source and fails with the client's.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.netns import Topology, inside
from tests.offload.harness import Pods, wait_listening

pytestmark = pytest.mark.netns

CLIENT, ENDPOINT = "10.244.9.20", "10.244.1.5"
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)


def dial(node: str, source: str | None) -> str:
    """Connect from the node to the endpoint, from `source` (transparently) or the node's own
    address; returns the peer the endpoint saw, or the error."""
    with inside(node):
        s = socket.socket()
    s.settimeout(2.0)
    try:
        if source is not None:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            s.bind((source, 0))
        s.connect((ENDPOINT, 8080))
        return s.recv(128).decode().split()[1]
    except OSError as err:
        return type(err).__name__
    finally:
        s.close()


def test_a_relay_cannot_dial_from_the_clients_address(topology: Topology, tmp_path: Path) -> None:
    pods = Pods(topology, tmp_path)
    try:
        pods.add("endpoint", ENDPOINT)
        client = topology.add_host("client", CLIENT)
        wait_listening(client, ENDPOINT, 8080)
        assert dial(topology.node, None) == "10.244.0.1"  # the relay's way: the node's address
        assert dial(topology.node, CLIENT) in ("TimeoutError", "ConnectionRefusedError", "ConnectionResetError")
    finally:
        pods.close()
