"""UDP fragments at tc (issue 29 item 4), in the cluster of hostile_lab.py.

The UDP NodePort "dns" has three endpoints, one per node (id-a, id-b, id-c: idsrv answers
"NAME|peer|" + the datagram). Each of six client sockets sends small datagrams and 3000-byte ones
(two fragments on the lab's 1500-byte links) to n1:NodePort, interleaved. Every answer of one
socket must come from one endpoint, from n1:NodePort, and be whole: the first fragment's ports
are remembered (usp_frags), so the later fragment follows it through the flow the small datagrams
have, both ways (the endpoint's 3000-byte answers are fragments too, reverse-NATed at tc). Before
issue 29 tc passed every fragment to the stack, the relay served the fragmented datagrams with a
choice of its own, and a socket's answers came from two endpoints (and the relay's big answers
from another source port of the pod's view).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tests.cluster.cluster import node_ip
from tests.cluster.hostile_lab import UDP_NP, dns_service, hostile_lab
from tests.netns import inside

pytestmark = pytest.mark.netns

N1 = node_ip(1)
BIG = 3000


def exchange(ns: str, sockets: int) -> list[list[tuple[str, int, tuple[str, int]]]]:
    """Per socket: (pod name, answer length, answer source) for small, big, small, big."""
    out = []
    for i in range(sockets):
        with inside(ns):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3.0)
        answers = []
        try:
            for n, size in enumerate((10, BIG, 10, BIG)):
                payload = (f"{i}.{n}:".encode() + b"x" * size)[:size]
                s.sendto(payload, (N1, UDP_NP))
                data, src = s.recvfrom(65535)
                name, _, echoed = data.split(b"|", 2)
                assert echoed == payload, (i, n, len(echoed))
                answers.append((name.decode(), len(echoed), src))
        finally:
            s.close()
        out.append(answers)
    return out


@pytest.mark.parametrize("mode", ["snat", "dsr"])
async def test_fragmented_and_small_datagrams_of_one_socket_reach_one_endpoint(tmp_path: Path, mode: str) -> None:
    pods = ["id-a", "id-b", "id-c"]
    async with hostile_lab(tmp_path, mode, pods, dns_service(pods)) as (c, _):
        got = await asyncio.to_thread(exchange, c.ns("ext"), 6)
        for answers in got:
            assert len({name for name, _, _ in answers}) == 1, got  # one endpoint per socket
            assert {src for _, _, src in answers} == {(N1, UDP_NP)}, got
            assert [size for _, size, _ in answers] == [10, BIG, 10, BIG], got
