"""Forged DSR options (issue 29 item 1), in the three-node cluster in DSR mode (hostile_lab.py).

The Service "push" (NodePort PUSH_NP) has one backend, push-b on n2; "id" (NodePort ID_NP) has
id-c on n3. An outside host (ext) writes the 0x9a option itself (packets.py) on packets it sends
straight to push-b, which the lan router routes to n2:
- a SYN whose option names an address no node of the cluster serves the NodePort at (6.6.6.6),
  n2's own address, n2's pod bridge address (a network of n2's, but not one the packet came in
  through), a real DSR frontend of another Service (push-b is not its backend) or a port that is
  no NodePort: n2 records nothing, and push-b's SYN-ACK leaves with push-b's own address. Before
  issue 29 n2 recorded the option for any NodePort port, and push-b answered from 6.6.6.6:PUSH_NP.
  An option naming what a genuine one names (n1's address and PUSH_NP, to a backend of push) is
  accepted: it is what the forger gets by sending that SYN to n1:PUSH_NP, which is what DSR trusts.
- an ACK and a SYN with an option naming n3:PUSH_NP on the tuple of a client's live DSR flow, a
  SYN without the option and a RST (random sequence numbers): n2's entry for the flow still names
  n1:PUSH_NP, the client's connection goes on, and a server push after 12 s of silence arrives
  (the RST did not mark the entry closing, which would have ended it 10 s later). Before issue 29
  the ACK rewrote the entry, the replies left as n3, and the connection stalled.
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest

from tests.cluster import packets
from tests.cluster.cluster import EXT, node_ip
from tests.cluster.hostile_lab import ID_NP, PUSH_NP, Line, hostile_lab, id_service, pod_ip, push_service
from tests.cluster.bpf_agents import ct_entries
from usproxy.offload.bpf.layout import CT_DSR, CT_REPLY

pytestmark = pytest.mark.netns

N1, N2, N3 = node_ip(1), node_ip(2), node_ip(3)
POD = pod_ip("push-b")


def syn_with_option(sport: int, named: tuple[str, int], flags: int = packets.TCP_SYN, seq: int = 1000) -> bytes:
    seg = packets.tcp(EXT, POD, sport, 8081, flags, seq=seq, ack=random.getrandbits(32) if flags & packets.TCP_ACK else 0)
    return packets.ipv4(EXT, POD, socket.IPPROTO_TCP, seg, options=packets.dsr_option(*named))


def reply_entries(c_pins: Path, port: int) -> list[tuple[str, int, bool]]:
    """n2's REPLY entries for the client port `port`: (named address, named port, DSR)."""
    return [(str(e.nat_saddr), e.nat_sport, bool(e.flags & CT_DSR)) for e in ct_entries(c_pins)
            if e.direction == CT_REPLY and str(e.daddr) == EXT and e.dport == port]


async def test_a_forged_option_makes_no_pod_answer_as_another_address(tmp_path: Path) -> None:
    pods = ["push-b", "id-c"]
    async with hostile_lab(tmp_path, "dsr", pods, push_service(["push-b"]) + id_service(["id-c"])) as (c, agents):
        forged = {41001: ("6.6.6.6", PUSH_NP), 41002: (N2, PUSH_NP), 41003: ("10.244.2.1", PUSH_NP),
                  41004: (N1, ID_NP), 41005: (N3, 9999)}
        genuine = {41010: (N1, PUSH_NP)}
        with packets.RawSender(c.ns("ext")) as sender, packets.sniffer(c.ns("ext"), socket.IPPROTO_TCP) as sniff:
            for port, named in {**forged, **genuine}.items():
                sender.send(syn_with_option(port, named))
            seen = await asyncio.to_thread(packets.sniffed, sniff, 2.0)
        synacks = {(p.dport, p.src, p.sport) for p in seen
                   if p.flags & packets.TCP_SYN and p.flags & packets.TCP_ACK and p.dport in {*forged, *genuine}}
        assert synacks == {*((port, POD, 8081) for port in forged), *((port, N1, PUSH_NP) for port in genuine)}, seen
        n2 = agents.dirs[2][0]
        for port in forged:
            assert reply_entries(n2, port) == [], port
        assert reply_entries(n2, 41010) == [(N1, PUSH_NP, True)]


async def test_a_forged_packet_never_moves_a_live_dsr_flow(tmp_path: Path) -> None:
    pods = ["push-b"]
    async with hostile_lab(tmp_path, "dsr", pods, push_service(pods)) as (c, agents):
        conn = await asyncio.to_thread(Line, c.ns("ext"), N1, PUSH_NP)
        try:
            assert conn.peer == EXT and conn.sock.getpeername() == (N1, PUSH_NP)  # DSR
            port = conn.sock.getsockname()[1]
            n2 = agents.dirs[2][0]
            assert reply_entries(n2, port) == [(N1, PUSH_NP, True)]
            flag = tmp_path / "push-now"

            def plain(flags: int) -> bytes:
                seg = packets.tcp(EXT, POD, port, 8081, flags, seq=random.getrandbits(32))
                return packets.ipv4(EXT, POD, socket.IPPROTO_TCP, seg)

            attacks = {"ACK with an option": syn_with_option(port, (N3, PUSH_NP), packets.TCP_ACK, random.getrandbits(32)),
                       "SYN with an option": syn_with_option(port, (N3, PUSH_NP), seq=random.getrandbits(32)),
                       "SYN without one": plain(packets.TCP_SYN), "RST": plain(packets.TCP_RST)}
            with packets.RawSender(c.ns("ext")) as sender:
                for what, pkt in attacks.items():
                    sender.send(pkt)
                    await asyncio.sleep(0.2)
                    assert reply_entries(n2, port) == [(N1, PUSH_NP, True)], what
                    assert await asyncio.to_thread(conn.ask, what) == what
            conn.send(f"wait {flag}")
            await asyncio.sleep(12)  # idle past CT_LIFETIME_CLOSING: the RST closed nothing
            flag.touch()
            assert await asyncio.to_thread(conn.line) == "pushed"
        finally:
            conn.close()
