"""Floods from one outside host drop no established flow (issue 29 item 2), and what the tc
program does with a segment of a flow it has no entry for.

The cluster of hostile_lab.py; the Services' only backend, push-b, runs on n2, so every flow the
client (ext) opens to n1's NodePort crosses to another node: SNATed at tc ("snat"), DSR ("dsr"),
at XDP on n1's uplink ("xdp"), or by nftables ("nftables", the control: kube-proxy's datapath).
A TCP connection is left idle waiting for a server push and a UDP session is open; then ext floods
n1 from one process with 150,000 spoofed SYNs (SNAT: then 150,000 spoofed ACKs and 150,000
one-datagram UDP flows too; packets.py: raw socket, struct-made packets, correct checksums, sources
across 203.0.113.128/25). Afterwards the push arrives, the connection echoes, the UDP session is
answered by the same pod from n1's NodePort, and a new connection works (at tc: a new flow may take
the SNAT port of a flow not confirmed yet; nftables, the control, holds the established flows but
new ones wait while the flood's unassured entries hold the masquerade ports). Before issue 29 usp_ct was
one LRU that every one of those packets wrote two entries into: the established entries were
evicted or their SNAT port taken, the push or the session's answer never arrived (SNAT and XDP:
each flood alone did it; DSR, one entry per flow on each node, held 150,000 SYNs; nftables held).

A segment of a TCP flow the table lost (deleted here by hand) creates no entry: at a SNAT
frontend it goes to the stack, which resets it, as kube-proxy's datapath does (the relay's listener
has no such connection); at a DSR frontend the backend is chosen again through the Maglev table
(the same one while the endpoints are the same) and the segment forwarded without an entry: the
backend's node still has the flow. An agent restart loses nothing: the tables are pinned.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from tests.cluster import packets
from tests.cluster.cluster import node_ip
from tests.cluster.hostile_lab import PUSH_NP, UDP_NP, Line, dns_service, hostile_lab, push_service
from tests.cluster.bpf_agents import ct_entries
from tests.netns import inside
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.layout import CT_MAPS, CtEntry

pytestmark = pytest.mark.netns

N1 = node_ip(1)
FLOOD = 150_000


def udp_session(ns: str) -> socket.socket:
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3.0)
    return s


def udp_ask(s: socket.socket, text: str, tries: int = 5) -> tuple[str, tuple[str, int]]:
    """The pod answering `text` and the answer's source; a few tries, as a datagram may be lost
    while the pod's socket still holds the flood."""
    for n in range(tries):
        s.sendto(f"{text} {n}".encode(), (N1, UDP_NP))
        try:
            data, src = s.recvfrom(4096)
        except (TimeoutError, socket.timeout):
            continue
        return data.decode().split("|", 1)[0], src
    raise TimeoutError(f"no answer to {tries} datagrams")


FLOODS = {"syn": packets.TCP_SYN, "ack": packets.TCP_ACK, "udp": 0}


@pytest.mark.parametrize(("mode", "floods"), [("nftables", "syn"), ("snat", "syn,ack,udp"), ("dsr", "syn"),
                                              ("xdp", "syn")])
async def test_a_flood_from_one_outside_host_drops_no_established_flow(tmp_path: Path, mode: str, floods: str) -> None:
    pods = ["push-b"]
    async with hostile_lab(tmp_path, mode, pods, push_service(pods) + dns_service(pods)) as (c, agents):
        ext = c.ns("ext")
        flag = tmp_path / "push-now"
        conn = await asyncio.to_thread(Line, ext, N1, PUSH_NP)
        dgram = udp_session(ext)
        try:
            assert conn.name == "push-b" and await asyncio.to_thread(conn.ask, "before") == "before"
            first = await asyncio.to_thread(udp_ask, dgram, "before")
            assert first == ("push-b", (N1, UDP_NP)), first
            conn.send(f"wait {flag}")  # idle from here on, until the server pushes
            for flood in floods.split(","):
                if flood == "udp":
                    took = await asyncio.to_thread(packets.flood_udp, ext, N1, UDP_NP, FLOOD)
                else:
                    took = await asyncio.to_thread(packets.flood_tcp, ext, N1, PUSH_NP, FLOOD, FLOODS[flood])
                print(f"{mode}: {FLOOD} spoofed {flood} in {took:.1f} s")
            flag.touch()
            conn.sock.settimeout(10.0)
            assert await asyncio.to_thread(conn.line) == "pushed", mode
            assert await asyncio.to_thread(conn.ask, "after") == "after"
            assert await asyncio.to_thread(udp_ask, dgram, "after") == first
            if mode != "nftables":  # there the flood's unassured entries hold every masquerade
                # port to push-b's address for up to 60 s (SYN_RECV): new connections wait for them
                fresh = await asyncio.to_thread(Line, ext, N1, PUSH_NP, 10.0)  # SYN retransmits allowed
                assert await asyncio.to_thread(fresh.ask, "new") == "new"
                fresh.close()
        finally:
            conn.close()
            dgram.close()
        if mode == "xdp":
            from tests.cluster.test_xdp_maglev import xdp_stats

            stats = xdp_stats(agents.dirs[1][0])
            assert stats["reply"] > 0 and stats["known"] > 0, stats  # the flow was XDP's


def delete_flow(pins: Path, client_port: int) -> int:
    """Delete every tc conntrack entry (any table) whose tuple holds `client_port`: a flow the
    tables lost. How many went."""
    gone = 0
    for name in CT_MAPS:
        fd = bpf.obj_get(str(loader.PinLayout(pins).maps / name))
        try:
            for key, _ in bpf.map_items(fd, CtEntry.KEY_SIZE, CT_MAPS[name]):
                e = CtEntry.unpack(key, bytes(CtEntry.VAL_SIZE))
                if client_port in (e.sport, e.dport):
                    gone += bpf.map_delete(fd, key)
        finally:
            os.close(fd)
    return gone


@pytest.mark.parametrize("mode", ["snat", "dsr"])
async def test_restart_keeps_flows_and_a_lost_flow_gets_no_entry_from_a_mid_stream_segment(tmp_path: Path, mode: str) -> None:
    pods = ["push-b"]
    async with hostile_lab(tmp_path, mode, pods, push_service(pods)) as (c, agents):
        ext = c.ns("ext")
        flag = tmp_path / "push-now"
        conn = await asyncio.to_thread(Line, ext, N1, PUSH_NP)
        try:
            conn.send(f"wait {flag}")
            for i in (1, 2):  # both nodes' agents restart while the connection is idle
                assert c.stop_agent(i) == 0
                await asyncio.to_thread(agents.start, i)
            await agents.settled((1, 2))
            flag.touch()
            assert await asyncio.to_thread(conn.line) == "pushed"
            assert await asyncio.to_thread(conn.ask, "after the restart") == "after the restart"
            port = conn.sock.getsockname()[1]
            assert delete_flow(agents.dirs[1][0], port) > 0  # n1 lost the flow
            if mode == "dsr":  # chosen again through Maglev, no entry: n2 still has the flow
                assert await asyncio.to_thread(conn.ask, "lost at n1") == "lost at n1"
                assert not [e for e in ct_entries(agents.dirs[1][0]) if port in (e.sport, e.dport)]
            else:  # to the stack, which resets it (nothing listens with that connection)
                with pytest.raises((ConnectionResetError, ConnectionError)):
                    await asyncio.to_thread(conn.ask, "lost at n1")
                assert not [e for e in ct_entries(agents.dirs[1][0]) if port in (e.sport, e.dport)]
        finally:
            conn.close()
