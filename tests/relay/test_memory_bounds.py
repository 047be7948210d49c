"""Memory (issue 18 item 4): what clients that never read cost the relay, while stuck and after.

Tried: 1 MiB of userspace buffer per leg for a client that does not read; 2,000 such flows took the
agent's RSS from 53 MiB to 2.2 GiB, and it stayed there after they closed. Now each leg buffers at
most HIGH_WATER bytes plus the read that crossed it before the other side stops reading
(usproxy/relay/tcp.py), so the stall reaches the endpoint, whose writes stop; and freed buffers go
back to the system (usproxy/util/heap.py).

Here, for real: an endpoint writes 16 MiB to every connection as fast as it is taken, FLOWS clients
connect through the ClusterIP and never read. Once every write has stalled: each flow holds at
most LEG_BOUND bytes in userspace (its bytes_out less the client leg's kernel queues), the bytes
the endpoint wrote that are in no kernel queue are at most LEG_BOUND per flow, and VmRSS grew by
less than 2 × LEG_BOUND per flow (a 1 MiB leg buffer fails all three). After the clients closed
and the heap trim ran, VmRSS is within 16 MiB of its size before (it kept 60 MiB without the trim).
The kernel memory of the agent's own two sockets per flow (`ss -m`) is reported, not bounded: the
relay cannot bound it without stalling flows that resume (README, Semantics, the memory item).
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside, nsexec
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc, vm_status
from tests.relay.tcp_clients import start_server, wait_until
from tests.relay.tcp_servers import MIB
from usproxy.util.heap import MIN_INTERVAL

pytestmark = pytest.mark.netns

VIP, BE, PORT = "10.96.71.1", "10.244.1.71", 9100
FLOWS = 300
LENGTH = 16 * MIB  # per connection: far more than every buffer on the way holds
# What one stuck flow may hold in the agent's userspace: the client leg's high-water mark (64 KiB,
# usproxy/relay/tcp.py) plus the read that crossed it (both loops read at most 256 KiB at a time).
LEG_BOUND = 64 * 1024 + 256 * 1024
TRIM_WAIT = MIN_INTERVAL + 2.0  # the sweep trims at most every MIN_INTERVAL seconds, once a second


class Flood:
    """The endpoint's written-bytes report (tcp_servers.py flood)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> tuple[int, int, int]:
        """(connections, bytes written in all, most written to one connection)."""
        try:
            conns, total, most = self.path.read_text().split()
        except (OSError, ValueError):
            return (0, 0, 0)
        return int(conns), int(total), int(most)

    def stalled(self, conns: int, quiet: float = 1.0, timeout: float = 60.0) -> tuple[int, int, int]:
        """Wait until `conns` connections are open and no write progressed for `quiet` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.read(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.read()
            if now != last:
                last, since = now, time.monotonic()
            elif now[0] >= conns and time.monotonic() - since >= quiet:
                return now
        raise TimeoutError(f"endpoint writes never stalled: {last}")


def queues(ns: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(local, peer) → (Recv-Q, Send-Q) of every TCP socket in `ns` that is not listening (from
    `ss`; a half-closed one too: an endpoint that finished writing may have closed)."""
    out = {}
    for line in nsexec(ns, "ss", "-tnH", "state", "connected").stdout.splitlines():
        cols = line.split()
        if not cols[0].isdigit():
            cols = cols[1:]  # the state column
        out[(cols[2], cols[3])] = (int(cols[0]), int(cols[1]))
    return out


def queued(*namespaces: str) -> int:
    """Bytes the kernel holds in the TCP sockets of `namespaces`: once every write stalled, what an
    endpoint wrote is in these queues or in the agent's userspace buffers, nowhere else."""
    return sum(r + s for ns in namespaces for r, s in queues(ns).values())


def skmem(ns: str) -> dict[tuple[str, str], int]:
    """(local, peer) → kernel memory of every TCP socket in `ns` that is not listening, in bytes:
    its receive queue's (skmem r, rmem_alloc) plus its send queue's (skmem w, wmem_queued), from
    `ss -m`, both counted with their buffers' overhead as tcp_mem counts them."""
    out: dict[tuple[str, str], int] = {}
    key: tuple[str, str] | None = None
    for line in nsexec(ns, "ss", "-tnmH", "state", "connected").stdout.splitlines():
        if "skmem:(" in line and key is not None:
            fields = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", line.split("skmem:(")[1].split(")")[0])}
            out[key] = fields["r"] + fields["w"]
            key = None
        elif line and not line[0].isspace():
            cols = line.split()
            if not cols[0].isdigit():
                cols = cols[1:]  # the state column
            key = (cols[2], cols[3])
    return out


def kernel_held(flows: list[dict[str, object]], node: str) -> list[int]:
    """Kernel memory each flow pins in the agent's own two sockets (client leg, endpoint leg)."""
    mem = skmem(node)
    out = []
    for f in flows:
        orig, rep = f["original"], f["reply"]
        assert isinstance(orig, dict) and isinstance(rep, dict)
        out.append(mem[(str(orig["dst"]), str(orig["src"]))] + mem[(str(rep["dst"]), str(rep["src"]))])
    return out


def buffered(flows: list[dict[str, object]], node: str, cli: str) -> list[int]:
    """Bytes each flow holds in the agent's userspace: what it read from the endpoint
    (bytes_out) less what the kernel holds on the client leg (the agent's Send-Q, the client's
    Recv-Q: the client never reads)."""
    agent, client = queues(node), queues(cli)
    out = []
    for f in flows:
        orig = f["original"]
        assert isinstance(orig, dict)
        src, dst = str(orig["src"]), str(orig["dst"])
        out.append(int(str(f["bytes_out"])) - agent[(dst, src)][1] - client[(src, dst)][0])
    return out


def open_clients(ns: str, n: int) -> list[socket.socket]:
    """`n` connections to the ClusterIP that never read, each receive buffer small (the kernel's
    part, outside the agent, kept small: 300 flows must not put the machine under tcp_mem pressure)."""
    out = []
    with inside(ns):
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.settimeout(5)
            s.connect((VIP, 80))
            out.append(s)
    return out


def test_clients_that_never_read_cost_a_bounded_buffer_and_give_it_back(
        topology: Topology, backends: Backends, workdir: Path, loop_name: str) -> None:
    be = topology.add_host("be", BE)
    log = workdir / "flood.txt"
    start_server(backends, be, "flood", BE, str(PORT), "--after", str(LENGTH), "--log", str(log))
    cli = topology.add_host("cli", "10.244.9.71")
    m = Manifests(workdir / "m")
    m.write(svc("flood", VIP, [{"name": "tcp", "port": 80, "targetPort": PORT}]),
            slice_("flood", [{"ip": BE, "ready": True}], [{"name": "tcp", "port": PORT, "protocol": "TCP"}]))
    agent = AgentProc(topology, m, loop_name)
    flood = Flood(log)
    clients: list[socket.socket] = []
    try:
        agent.start()
        warm = open_clients(cli, 20)  # the loop's and the allocator's steady shape first
        flood.stalled(20)
        for s in warm:
            s.close()
        assert wait_until(lambda: agent.flows() == [], 10.0)
        time.sleep(1.0)
        before = vm_status(agent.pid(), "VmRSS")
        written_before = flood.read()[1]

        clients = open_clients(cli, FLOWS)
        _, total, most = flood.stalled(20 + FLOWS)
        during = vm_status(agent.pid(), "VmRSS")
        wrote = (total - written_before) / FLOWS
        unsent = (total - written_before - queued(be, topology.node, cli)) / FLOWS
        flows = agent.flows()
        assert len(flows) == FLOWS
        held = buffered(flows, topology.node, cli)
        kernel = kernel_held(flows, topology.node)

        for s in clients:
            s.close()  # unread data: each close is a reset
        clients = []
        assert wait_until(lambda: agent.flows() == [], 10.0)
        time.sleep(TRIM_WAIT)
        after = vm_status(agent.pid(), "VmRSS")
        rss = (during - before) / FLOWS
        print(f"\n{loop_name}, {FLOWS} flows: RSS before {before / MIB:.1f} MiB, stuck {during / MIB:.1f} MiB "
              f"({rss / 1024:.0f} KiB/flow), after {after / MIB:.1f} MiB; buffered per flow: mean "
              f"{sum(held) / FLOWS / 1024:.0f} KiB, most {max(held) / 1024:.0f} KiB; the endpoint wrote "
              f"{wrote / MIB:.2f} MiB/conn (most {most / MIB:.2f}), {unsent / 1024:.0f} KiB/conn outside the kernel; "
              f"kernel memory per flow in the agent's sockets: mean {sum(kernel) / FLOWS / 1024:.0f} KiB, "
              f"most {max(kernel) / 1024:.0f} KiB")
        assert max(held) <= LEG_BOUND, f"a flow buffered {max(held)} bytes"
        assert unsent <= LEG_BOUND, f"{unsent:.0f} bytes per flow written by the endpoint, in no kernel queue"
        assert wrote < LENGTH * 3 / 4, "the endpoint's writes did not stall"
        assert rss < 2 * LEG_BOUND, f"{rss / 1024:.0f} KiB of RSS per stuck flow"
        assert after - before < 16 * MIB, f"RSS {before / MIB:.0f} MiB -> {after / MIB:.0f} MiB after they closed"
    finally:
        for s in clients:
            s.close()
        assert agent.stop() == 0
