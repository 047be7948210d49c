"""NodePorts at XDP and Maglev across nodes, in the three-node cluster (issue 16 items 3 and 4).

Every node runs `usproxy run --offload bpf` with its own pins and cgroup (as test_tc_nodeport.py):
- n1 with --bpf-lb-acceleration native and an XDP program on the lan side of its eth0 (a veth:
  frames sent with XDP_TX are polled at the peer only then; Cluster.uplink_xdp): XDP serves its
  NodePort flows to backends on other nodes in both directions, client to backend (DNAT+SNAT) and
  the replies (reverse NAT); the per-CPU counters in n1's own pinned usp_xdp_stats say so, and the
  veth's own counters (ethtool -S) that every frame XDP sent reached the peer. tc serves what XDP
  passes: a backend behind the pod bridge cbr0 (no native XDP), and web-c's replies, which keep
  the partial checksums of its socket's checksum offload (every other sender here has complete
  ones, as from a wire: Cluster.wire_checksums);
- n2 with --bpf-lb-acceleration native and only GRO on its eth0's peer: the probe refuses XDP there
  (the peer would never poll the frames), says why, nothing is attached, tc serves;
- n3 with acceleration disabled: tc only.
`usproxy check` says the same per interface. Maglev: one set of client 5-tuples (source ports fixed
with bind) lands on the same backends through n1 (XDP) and n2 (tc); after one backend's removal the
same tuples through n3 move only if they were on it. An agent restart swaps the pinned XDP link to
the new program with the flow intact, and `--cleanup` detaches it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cluster.bpf_agents import Agents, node_dirs, served_by_bpf
from tests.cluster.cluster import EXT, LAN, Cluster, ethtool_stats, node_ip
from tests.cluster.workload import connect, echo, service, slice_of
from tests.netns import inside
from tests.relay.harness import USPROXY
from tests.sources.fake_apiserver import FakeApiServer
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.layout import BackendVal, pack_u32

pytestmark = pytest.mark.netns

NP = 30090
PODS = [("10.244.1.10", 1), ("10.244.2.10", 2), ("10.244.2.11", 2), ("10.244.3.10", 3)]
NAMES = {"10.244.1.10": "web-a", "10.244.2.10": "web-b", "10.244.2.11": "web-d", "10.244.3.10": "web-c"}
ACCELERATION = {1: "native", 2: "native", 3: "disabled"}
PORTS = range(42000, 42040)  # the client's fixed source ports
OFFLOADING = "web-c"  # the one pod whose socket keeps tx checksum offload (partial checksums)
XDP_STATS = ("new", "known", "pass", "reply", "partial")  # xdp_lb.h XDP_STAT_*


class XdpAgents(Agents):
    def flags(self, i: int) -> tuple[str, ...]:
        return (*super().flags(i), "--bpf-lb-acceleration", ACCELERATION[i])


@pytest.fixture
async def xdp_cluster(tmp_path: Path) -> AsyncIterator[tuple[Cluster, XdpAgents, FakeApiServer]]:
    from tests.sources.fake_apiserver import kubeconfig_text

    c = Cluster(tmp_path)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    with node_dirs(secrets.token_hex(3)) as dirs:
        try:
            c.build()
            c.uplink_xdp(1)
            c.uplink_gro(2)
            c.wire_checksums(c.ns("ext"))
            for ip, n in PODS:
                pod = c.add_pod(n, NAMES[ip], ip)
                if NAMES[ip] != OFFLOADING:
                    c.wire_checksums(pod)
            with inside(c.ns("lan")):
                await api.start()
            api.apply("services", service("web", "10.96.20.20", NP, "Cluster"))
            api.apply("endpointslices", slice_of("web", PODS))
            kc = tmp_path / "kubeconfig"
            kc.write_text(kubeconfig_text(api.url))
            agents = XdpAgents(c, kc, dirs)
            for i in (1, 2, 3):
                await asyncio.to_thread(agents.start, i)
            await served_by_bpf(c, range(1, 4))
            yield c, agents, api
        finally:
            await asyncio.to_thread(c.close)
            await api.stop()


def xdp_stats(pins: Path) -> dict[str, int]:
    fd = bpf.obj_get(str(loader.PinLayout(pins).maps / "usp_xdp_stats"))
    try:
        return {name: bpf.percpu_sum_u64(fd, pack_u32(i)) for i, name in enumerate(XDP_STATS)}
    finally:
        os.close(fd)


def xdp_links(pins: Path) -> dict[str, dict[str, str]]:
    return {k: v for k, v in loader.attached_links(loader.PinLayout(pins)).items() if k.startswith("usp_xdp@")}


def ifindex(ns: str, name: str) -> int:
    with inside(ns):
        return socket.if_nametoindex(name)


def check_xdp_row(c: Cluster, i: int) -> dict[str, object]:
    done = subprocess.run(["nsenter", f"--net=/run/netns/{c.node(i)}", USPROXY, "check", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return next(r for r in json.loads(done.stdout) if r["name"] == "bpf xdp")


def ask_from(ns: str, sport: int, addr: str, port: int) -> str:
    """The pod name answering a connection from EXT:`sport` (fixed source port)."""
    with inside(ns):
        s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last round's TIME_WAIT
    s.settimeout(2.0)
    try:
        s.bind((EXT, sport))
        s.connect((addr, port))
        return s.recv(128).decode().split()[0]
    finally:
        s.close()


def veth_stats(ns: str, name: str) -> dict[str, int]:
    with inside(ns):
        return ethtool_stats(name)


def tcp_counters(ns: str) -> dict[str, int]:
    """The Tcp: line of `ns`'s /proc/net/snmp (RetransSegs, InCsumErrors, ...)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True,
                         check=True).stdout
    names, values = [line.split()[1:] for line in out.splitlines() if line.startswith("Tcp:")]
    return dict(zip(names, map(int, values)))


def talk(ns: str, addr: str, port: int, data: bytes) -> str:
    """One connection: the greeting's pod name, then `data` echoed back whole."""
    with inside(ns):
        s = socket.socket()
    s.settimeout(2.0)
    try:
        s.connect((addr, port))
        name = s.recv(128).decode().split()[0]
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = s.recv(65536)
            assert chunk, (name, len(got))
            got += chunk
        assert got == data, name
        return name
    finally:
        s.close()


def backends_at(pins: Path) -> set[str]:
    fd = bpf.obj_get(str(loader.PinLayout(pins).maps / "usp_backends"))
    try:
        return {str(BackendVal.unpack(v).ip) for _, v in bpf.map_items(fd, 4, BackendVal.SIZE)}
    finally:
        os.close(fd)


async def test_xdp_serves_where_native_and_tc_elsewhere(xdp_cluster: tuple[Cluster, XdpAgents, FakeApiServer]) -> None:
    c, agents, _ = xdp_cluster
    ext, lan = c.ns("ext"), c.ns("lan")
    n1_eth0 = ifindex(c.node(1), "eth0")
    assert list(xdp_links(agents.dirs[1][0])) == [f"usp_xdp@{n1_eth0}"]  # not on cbr0 (a bridge)
    assert xdp_links(agents.dirs[2][0]) == {} and xdp_links(agents.dirs[3][0]) == {}
    row1, row2 = check_xdp_row(c, 1), check_xdp_row(c, 2)
    assert row1["available"] and "XDP (native) on eth0" in str(row1["detail"]), row1
    assert "tc only on cbr0 (no native XDP in its driver (bridge))" in str(row1["detail"]), row1
    assert not row2["available"], row2
    assert "tc only on eth0 (veth whose peer runs GRO but no XDP program" in str(row2["detail"]), row2

    stats0, tx0, peer0, tcp0 = (xdp_stats(agents.dirs[1][0]), veth_stats(c.node(1), "eth0"),
                                veth_stats(lan, c.uplinks[1]), tcp_counters(ext))
    data = os.urandom(6000)  # several segments each way
    seen = [await asyncio.to_thread(talk, ext, node_ip(1), NP, data) for _ in range(40)]
    stats = {k: v - stats0[k] for k, v in xdp_stats(agents.dirs[1][0]).items()}
    tx = {k: v - tx0[k] for k, v in veth_stats(c.node(1), "eth0").items()}
    peer = {k: v - peer0[k] for k, v in veth_stats(lan, c.uplinks[1]).items()}
    tcp = {k: v - tcp0[k] for k, v in tcp_counters(ext).items()}
    assert set(seen) <= set(NAMES.values()) and {"web-b", "web-d", OFFLOADING} <= set(seen), seen
    # every flow's first packet meets the XDP program once: sent by it, or passed to tc
    assert stats["new"] + stats["pass"] == len(seen), (stats, seen)
    assert stats["pass"] >= seen.count("web-a"), stats  # web-a is behind cbr0: tc's
    assert stats["new"] >= 1 and stats["known"] >= 1, stats  # client to backend at XDP
    assert stats["reply"] >= 1, stats  # web-b's and web-d's replies reverse-NATed at XDP
    assert stats["partial"] >= 1, stats  # web-c's replies (partial checksums) left to tc
    # every frame XDP sent left for the peer, and the peer polled it: nothing lost on the way
    assert tx["rx_queue_0_xdp_tx"] == stats["new"] + stats["known"] + stats["reply"], (tx, stats)
    assert tx["rx_queue_0_xdp_tx_errors"] == 0 and peer["rx_queue_0_drops"] == 0, (tx, peer)
    assert peer["rx_queue_0_xdp_packets"] >= tx["rx_queue_0_xdp_tx"], (peer, tx)
    assert tcp["InCsumErrors"] == 0 and tcp["RetransSegs"] == 0, tcp  # the client lost nothing
    for i in (2, 3):  # no XDP there: tc serves, the counters stay at zero
        assert await asyncio.to_thread(talk, ext, node_ip(i), NP, data) in NAMES.values()
        assert set(xdp_stats(agents.dirs[i][0]).values()) == {0}


async def test_maglev_picks_one_backend_per_flow_on_every_node(xdp_cluster: tuple[Cluster, XdpAgents, FakeApiServer]) -> None:
    c, agents, api = xdp_cluster
    ext = c.ns("ext")
    via1 = {p: await asyncio.to_thread(ask_from, ext, p, node_ip(1), NP) for p in PORTS}
    via2 = {p: await asyncio.to_thread(ask_from, ext, p, node_ip(2), NP) for p in PORTS}
    assert via1 == via2  # n1 (XDP) and n2 (tc): the same table, the same hash
    assert len(set(via1.values())) >= 3, via1  # spread, not one backend
    assert xdp_stats(agents.dirs[1][0])["new"] >= 1  # n1's flows went through XDP

    api.apply("endpointslices", slice_of("web", [p for p in PODS if NAMES[p[0]] != "web-c"]))
    deadline = time.monotonic() + 10
    while "10.244.3.10" in backends_at(agents.dirs[3][0]):
        assert time.monotonic() < deadline, "n3 did not drop web-c"
        await asyncio.sleep(0.1)
    via3 = {p: await asyncio.to_thread(ask_from, ext, p, node_ip(3), NP) for p in PORTS}
    moved = {p for p in PORTS if via3[p] != via1[p]}
    on_c = {p for p in PORTS if via1[p] == "web-c"}
    assert on_c and moved == on_c, (via1, via3)  # only web-c's share moved


async def test_restart_swaps_the_xdp_link_and_cleanup_detaches_it(xdp_cluster: tuple[Cluster, XdpAgents, FakeApiServer]) -> None:
    c, agents, _ = xdp_cluster
    ext, pins = c.ns("ext"), agents.dirs[1][0]
    before = xdp_links(pins)
    s, name, _ = await asyncio.to_thread(connect, ext, node_ip(1), NP)
    try:
        assert c.stop_agent(1) == 0
        assert await asyncio.to_thread(echo, s, b"agent down\n") == b"agent down\n"
        await asyncio.to_thread(agents.start, 1)
        await served_by_bpf(c, range(1, 2))
        assert await asyncio.to_thread(echo, s, b"agent back\n") == b"agent back\n"
        after = xdp_links(pins)
        assert list(after) == list(before), (before, after)
        link = next(iter(after))
        assert after[link]["prog_id"] != before[link]["prog_id"], (before, after)  # swapped in place
    finally:
        s.close()
    assert c.stop_agent(1) == 0
    done = subprocess.run(["nsenter", f"--net=/run/netns/{c.node(1)}", USPROXY, "run", "--cleanup",
                           *agents.flags(1)], env={**os.environ, **agents.env(1)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not pins.exists()
    shown = subprocess.run(["ip", "-n", c.node(1), "-d", "link", "show", "eth0"], capture_output=True, text=True)
    assert "prog/xdp" not in shown.stdout, shown.stdout
