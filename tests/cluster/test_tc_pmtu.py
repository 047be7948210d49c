"""ICMP errors of flows the tc programs NAT (issue 29 item 3), in the cluster of hostile_lab.py.

Path MTU: the lan router's link towards the client (ext) gets MTU 1400 on the router's side
only, so the client still offers MSS 1460 and push-b (on n2, the Service's only backend) sends
full-size segments that the router cannot forward: it answers "fragmentation needed" to their
source, which is n1:NodePort (the reply was reverse-NATed at n1, or left n2 with n1's address in
DSR mode). The error must reach push-b, turned back into what push-b sent, for a 2 MB download
through n1's NodePort to finish. Before issue 29 it went to n1's stack, which had no such
connection, and the download stalled at 0 bytes in SNAT and DSR mode; nftables (the control,
kube-proxy's datapath) relates the error to its conntrack entry and passes.

Unreachable in general: a UDP NodePort whose endpoint has no socket on its port (push-b:9) makes
push-b answer "port unreachable", which must reach the client as an error about what the client
sent (client -> n1:NodePort): its connected UDP socket then fails with ECONNREFUSED at once, as
with nftables. Before, the error went to n1's stack too, and the client waited in vain.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster import EXT, node_ip
from tests.cluster.hostile_lab import PUSH_NP, Line, hostile_lab, pod_ip, pod_node, push_service
from tests.cluster.workload import udp_service, udp_slice
from tests.netns import inside, nsexec

pytestmark = pytest.mark.netns

N1 = node_ip(1)
CLOSED_NP = 30293
SIZE = 2_000_000


def closed_udp_service(pod: str) -> list[tuple[str, dict[str, Any]]]:
    """A UDP NodePort whose endpoint is `pod`'s port 9, where nothing listens."""
    svc = udp_service("closed", "10.96.29.13", CLOSED_NP)
    svc["spec"]["ports"][0]["targetPort"] = 9
    eps = udp_slice("closed", [(pod_ip(pod), pod_node(pod))])
    eps["ports"][0]["port"] = 9
    return [("services", svc), ("endpointslices", eps)]


def download(conn: Line, size: int, seconds: float) -> int:
    """Ask pushsrv for `size` bytes and read them; how many arrived within `seconds`."""
    conn.sock.sendall(f"bulk {size}\n".encode())
    got, tail = 0, b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        conn.sock.settimeout(left)
        try:
            chunk = conn.sock.recv(1 << 20)
        except (TimeoutError, socket.timeout):
            break
        if not chunk:
            break
        got += len(chunk)
        tail = (tail + chunk)[-5:]
        if tail == b"done\n" and got >= size:
            break
    return got


def udp_error(ns: str, addr: str, port: int) -> str:
    """What a connected UDP socket gets for a datagram to `addr`:`port`: "refused", "answer" or
    "timeout"."""
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    try:
        s.connect((addr, port))
        for _ in range(3):
            s.send(b"anyone?")
            try:
                s.recv(100)
                return "answer"
            except ConnectionRefusedError:
                return "refused"
            except (TimeoutError, socket.timeout):
                continue
        return "timeout"
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["nftables", "snat", "dsr"])
async def test_a_download_behind_a_smaller_hop_and_an_unreachable_port(tmp_path: Path, mode: str) -> None:
    pods = ["push-b"]
    async with hostile_lab(tmp_path, mode, pods, push_service(pods) + closed_udp_service("push-b")) as (c, agents):
        lan = c.ns("lan")
        dev = json.loads(nsexec(lan, "ip", "-j", "route", "get", EXT).stdout)[0]["dev"]
        nsexec(lan, "ip", "link", "set", dev, "mtu", "1400")
        conn = await asyncio.to_thread(Line, c.ns("ext"), N1, PUSH_NP)
        try:
            assert conn.name == "push-b"
            got = await asyncio.to_thread(download, conn, SIZE, 30.0)
            assert got == SIZE + len("done\n"), f"{mode}: {got} of {SIZE} bytes"
        finally:
            conn.close()
        assert await asyncio.to_thread(udp_error, c.ns("ext"), N1, CLOSED_NP) == "refused", mode
