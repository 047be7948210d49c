"""Kernel conntrack entries made in bulk for the cleanup tests: `fill_udp` creates N UDP entries
that look DNATed to an endpoint (original client -> frontend, reply endpoint -> client), through
ctnetlink's IPCTNL_MSG_CT_NEW in batches (usproxy.offload.ctnetlink's message helpers), in the
network namespace of the calling thread (tests.netns.inside). 150,000 take a few seconds, where
as many real flows would need a packet generator; the live sessions the tests judge are real
traffic beside them. Clients are 10.244.200.0/22 by default (one address per 60,000 ports), so
they never collide with a test's own hosts."""

from __future__ import annotations

import socket
import struct

from usproxy.offload import ctnetlink as c


def fill_udp(n: int, frontend: tuple[str, int], endpoint: tuple[str, int], timeout: int = 600,
             clients: str = "10.244.200.0") -> int:
    """Create `n` entries from addresses after `clients`; returns how many the kernel took. Two
    calls with the same frontend need different `clients` (an entry is known by its tuple)."""
    base = struct.unpack("!I", socket.inet_aton(clients))[0]
    vip, ep = socket.inet_aton(frontend[0]), socket.inet_aton(endpoint[0])
    messages = []
    for i in range(n):
        client = struct.pack("!I", base + 1 + i // 60000)
        sport = 1024 + i % 60000
        orig = c.tuple_attr(c.CTA_TUPLE_ORIG, socket.AF_INET, client, vip, sport, frontend[1], socket.IPPROTO_UDP)
        reply = c.tuple_attr(c.CTA_TUPLE_REPLY, socket.AF_INET, ep, client, endpoint[1], sport, socket.IPPROTO_UDP)
        body = orig + reply + c.attr(c.CTA_TIMEOUT, struct.pack("!I", timeout))
        messages.append(c.message(c.IPCTNL_MSG_CT_NEW, c.NLM_F_REQUEST | c.NLM_F_CREATE, socket.AF_INET, body))
    ct = c.Conntrack()
    try:
        return ct.send_batched(messages)
    finally:
        ct.close()
