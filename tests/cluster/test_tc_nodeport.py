"""NodePort at tc in the BPF datapath, across the three-node cluster (issue 16 item 1, SNAT mode).

Every node runs `usproxy run --offload bpf` with its own pins and its own throwaway cgroup
(started with nsenter: `ip netns exec` would hide bpffs and cgroup2). An external client reaches
NodePorts on the nodes' 192.0.2.1N addresses:
- externalTrafficPolicy Cluster (TCP and UDP): a backend on another node sees the node's address
  (SNAT to the address of the interface the backend is reached through), a backend behind the
  node's own pod bridge sees the bridge's address (the bridge is a hooked interface too, as every
  interface with a non-loopback address is without --nodeport-addresses); replies reach the client;
  a connection and a UDP flow keep their backend; the node's BPF connection-tracking map holds the
  flow and the node has no nftables rule for the NodePort (the tc path carried it, not nftables;
  not the relay either: eTP=Local keeps the client address, which the relay cannot);
- externalTrafficPolicy Local: the node with the endpoint keeps the client's address, a node
  without one drops (as kube-proxy);
- sessionAffinity ClientIP holds at tc (one backend per client address, an affinity entry keyed by
  it); a NodePort without endpoints is refused at once (tc passes it to the stack, nothing listens);
- an agent restart keeps an established external connection, and `usproxy run --cleanup` detaches
  the tc programs and removes the pins.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.cluster.bpf_agents import Agents, ct_entries, node_dirs, served_by_bpf
from tests.cluster.cluster import EXT, LAN, Cluster, node_ip
from tests.cluster.workload import ask, connect, echo, service, slice_of, udp_service, udp_slice
from tests.netns import inside, nsexec
from tests.relay.harness import USPROXY
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader, view
from usproxy.offload.bpf.layout import CT_ORIGINAL, AffinityEntry

pytestmark = pytest.mark.netns

WEB_NP, LOCAL_NP, UDP_NP, STICKY_NP, EMPTY_NP = 30080, 30081, 30082, 30083, 30084
N1 = node_ip(1)
N1_BRIDGE = "10.244.1.1"


def affinity_entries(pins: Path) -> list[AffinityEntry]:
    fd = bpf.obj_get(str(loader.PinLayout(pins).maps / "usp_affinity"))
    try:
        return [AffinityEntry.unpack(k, v) for k, v in bpf.map_items(fd, AffinityEntry.KEY_SIZE, AffinityEntry.VAL_SIZE)]
    finally:
        os.close(fd)


def tc_programs(ns: str, ifname: str) -> dict[str, list[int]]:
    """Program ids attached with tcx to `ifname` in netns `ns`, per direction."""
    with inside(ns):
        ifindex = socket.if_nametoindex(ifname)
        return {d: bpf.prog_query(ifindex, at) for d, at in
                (("ingress", bpf.BPF_TCX_INGRESS), ("egress", bpf.BPF_TCX_EGRESS))}


@pytest.fixture
async def bpf_cluster(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Agents]]:
    from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

    c = Cluster(tmp_path)
    api = FakeApiServer(bookmark_interval=0.2, host=LAN)
    with node_dirs(secrets.token_hex(3)) as dirs:
        try:
            c.build()
            c.add_pod(1, "web-a", "10.244.1.10")
            c.add_pod(2, "web-b", "10.244.2.10")
            c.add_pod(3, "web-c", "10.244.3.10")
            c.add_pod(1, "local-a", "10.244.1.11")
            with inside(c.ns("lan")):
                await api.start()
            api.apply("services", service("web", "10.96.20.10", WEB_NP, "Cluster"))
            api.apply("endpointslices", slice_of("web", [("10.244.1.10", 1), ("10.244.2.10", 2), ("10.244.3.10", 3)]))
            api.apply("services", service("local", "10.96.20.11", LOCAL_NP, "Local"))
            api.apply("endpointslices", slice_of("local", [("10.244.1.11", 1)]))
            api.apply("services", udp_service("dns", "10.96.20.12", UDP_NP))
            api.apply("endpointslices", udp_slice("dns", [("10.244.2.10", 2), ("10.244.3.10", 3)]))
            api.apply("services", service("sticky", "10.96.20.13", STICKY_NP, "Cluster", sessionAffinity="ClientIP"))
            api.apply("endpointslices", slice_of("sticky", [("10.244.1.10", 1), ("10.244.2.10", 2), ("10.244.3.10", 3)]))
            api.apply("services", service("empty", "10.96.20.14", EMPTY_NP, "Cluster"))
            kc = tmp_path / "kubeconfig"
            kc.write_text(kubeconfig_text(api.url))
            agents = Agents(c, kc, dirs)
            for i in (1, 2, 3):
                await asyncio.to_thread(agents.start, i)
            await served_by_bpf(c, range(1, 4))
            yield c, agents
        finally:
            await asyncio.to_thread(c.close)
            await api.stop()


def udp_ask(ns: str, addr: str, port: int, count: int) -> list[tuple[str, str]]:
    """`count` datagrams from one socket: (pod name, peer it saw) per answer."""
    with inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    out = []
    try:
        for n in range(count):
            s.sendto(f"ping{n}".encode(), (addr, port))
            name, peer, _ = s.recv(256).decode().split("|", 2)
            out.append((name, peer))
    finally:
        s.close()
    return out


async def test_cluster_policy_nodeport_is_dnated_and_snated_at_tc(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, agents = bpf_cluster
    ext = c.ns("ext")
    seen = [await asyncio.to_thread(ask, ext, N1, WEB_NP) for _ in range(12)]
    names = {name for name, _ in seen}
    assert names & {"web-b", "web-c"}, seen  # answered from pods on other nodes
    for name, peer in seen:  # SNAT to the address of the interface the backend is reached through
        assert peer == (N1_BRIDGE if name == "web-a" else N1), seen
    flows = [e for e in ct_entries(agents.dirs[1][0]) if e.direction == CT_ORIGINAL and e.dport == WEB_NP]
    assert flows and all(str(e.saddr) == EXT and str(e.daddr) == N1 for e in flows), flows
    assert {str(e.nat_saddr) for e in flows} <= {N1, N1_BRIDGE}, flows
    ruleset = nsexec(c.node(1), "nft", "list", "ruleset").stdout
    assert str(WEB_NP) not in ruleset, ruleset
    rows = await asyncio.to_thread(c.admin, 1, "/flows")
    assert any(r.get("datapath") == "bpf-tc" and r["original"]["src"].startswith(EXT) for r in rows), rows
    text = view.render_pinned(agents.dirs[1][0]) or ""  # what `usproxy explain --live` prints
    assert "link usp_tc_ingress@" in text and f"tcp {EXT}:" in text and f"-> {N1}:{WEB_NP} =>" in text, text


async def test_connections_and_udp_flows_keep_their_backend(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, _ = bpf_cluster
    ext = c.ns("ext")
    s, name, peer = await asyncio.to_thread(connect, ext, N1, WEB_NP)
    try:
        for n in range(20):  # the echo comes back only while the flow stays on its first backend
            assert await asyncio.to_thread(echo, s, f"line {n}\n".encode()) == f"line {n}\n".encode()
            await asyncio.sleep(0.05)
    finally:
        s.close()
    answers = await asyncio.to_thread(udp_ask, ext, N1, UDP_NP, 10)
    assert len(answers) == 10 and len(set(answers)) == 1, answers
    assert answers[0][0] in ("web-b", "web-c") and answers[0][1] == N1, answers


async def test_local_policy_keeps_the_client_address_and_drops_without_endpoint(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, agents = bpf_cluster
    ext = c.ns("ext")
    assert await asyncio.to_thread(ask, ext, N1, LOCAL_NP) == ("local-a", EXT)
    flows = [e for e in ct_entries(agents.dirs[1][0]) if e.direction == CT_ORIGINAL and e.dport == LOCAL_NP]
    assert flows and all(int(e.nat_saddr) == 0 for e in flows), flows  # no SNAT
    for i in (2, 3):  # no local endpoint: dropped at tc, as kube-proxy
        assert await asyncio.to_thread(ask, ext, node_ip(i), LOCAL_NP, 1.0) == ("timeout", "")


async def test_client_ip_affinity_holds_at_tc_by_client_address(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, agents = bpf_cluster
    seen = [await asyncio.to_thread(ask, c.ns("ext"), N1, STICKY_NP) for _ in range(10)]
    assert len({name for name, _ in seen}) == 1 and seen[0][0].startswith("web-"), seen
    client = int.from_bytes(socket.inet_aton(EXT), "little")  # the u32 as the program loads it
    assert any(e.client == client for e in affinity_entries(agents.dirs[1][0])), "no tc affinity entry"
    flows = [e for e in ct_entries(agents.dirs[1][0]) if e.direction == CT_ORIGINAL and e.dport == STICKY_NP]
    assert len({e.backend_id for e in flows}) == 1 and len(flows) == 10, flows  # every flow NATed at tc


async def test_a_nodeport_without_endpoints_is_refused_at_once(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, _ = bpf_cluster
    for i in (1, 2):  # tc passes it to the stack: no listener, the kernel refuses (kube-proxy REJECTs)
        start = time.monotonic()
        assert await asyncio.to_thread(ask, c.ns("ext"), node_ip(i), EMPTY_NP, 2.0) == ("refused", "")
        assert time.monotonic() - start < 0.5
    rows = await asyncio.to_thread(c.admin, 1, "/services")
    empty = next(r for r in rows if r["servicePortName"].startswith("default/empty"))
    assert empty["external"] == "tc" and "refuses" in empty["externalReason"], empty


def tc_addrs(pins: Path) -> set[str]:
    """The addresses in usp_tc_addrs: where the tc programs serve NodePorts."""
    fd = bpf.obj_get(str(loader.PinLayout(pins).maps / "usp_tc_addrs"))
    try:
        return {socket.inet_ntoa(k) for k in bpf.map_keys(fd, 4)}
    finally:
        os.close(fd)


async def wait_until(what: str, ok: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(0.1)


async def test_an_address_added_while_running_is_served_at_tc(bpf_cluster: tuple[Cluster, Agents]) -> None:
    """The tc programs follow the NodePort addresses of the interfaces they run on: an address
    added to eth0 while the agent runs is served at tc (not by the nftables fallback), one removed
    leaves usp_tc_addrs, and a connection through the node's first address talks across both."""
    c, agents = bpf_cluster
    pins, extra = agents.dirs[1][0], "192.0.2.91"
    assert extra not in tc_addrs(pins) and N1 in tc_addrs(pins)
    s, _, _ = await asyncio.to_thread(connect, c.ns("ext"), N1, WEB_NP)  # long-lived, across both changes
    try:
        nsexec(c.node(1), "ip", "addr", "add", f"{extra}/24", "dev", "eth0")
        await wait_until(f"{extra} never entered usp_tc_addrs\n{c.log(1)[-2000:]}", lambda: extra in tc_addrs(pins))
        assert await asyncio.to_thread(echo, s, b"after the add\n") == b"after the add\n"
        name, peer = await asyncio.to_thread(ask, c.ns("ext"), extra, WEB_NP)
        assert name.startswith("web-"), (name, peer)
        flows = [e for e in ct_entries(pins) if e.direction == CT_ORIGINAL and str(e.daddr) == extra]
        assert flows and all(e.dport == WEB_NP and str(e.saddr) == EXT for e in flows), flows  # NATed at tc
        nsexec(c.node(1), "ip", "addr", "del", f"{extra}/24", "dev", "eth0")
        await wait_until(f"{extra} never left usp_tc_addrs", lambda: extra not in tc_addrs(pins))
        assert await asyncio.to_thread(echo, s, b"after the del\n") == b"after the del\n"
    finally:
        s.close()
    assert N1 in tc_addrs(pins)
    name, _ = await asyncio.to_thread(ask, c.ns("ext"), N1, WEB_NP)
    assert name.startswith("web-"), name


async def test_restart_keeps_established_flows_and_cleanup_detaches(bpf_cluster: tuple[Cluster, Agents]) -> None:
    c, agents = bpf_cluster
    ext = c.ns("ext")
    before = tc_programs(c.node(1), "eth0")
    assert before["ingress"] and before["egress"], before
    s, _, _ = await asyncio.to_thread(connect, ext, N1, WEB_NP)
    try:
        assert c.stop_agent(1) == 0
        assert await asyncio.to_thread(echo, s, b"agent down\n") == b"agent down\n"
        assert tc_programs(c.node(1), "eth0") == before  # pinned links outlive the agent
        await asyncio.to_thread(agents.start, 1)
        await served_by_bpf(c, range(1, 2))
        assert await asyncio.to_thread(echo, s, b"agent back\n") == b"agent back\n"
        after = tc_programs(c.node(1), "eth0")
        assert len(after["ingress"]) == 1 and after["ingress"] != before["ingress"], (before, after)  # swapped
    finally:
        s.close()
    assert c.stop_agent(1) == 0
    done = subprocess.run(["nsenter", f"--net=/run/netns/{c.node(1)}", USPROXY, "run", "--cleanup",
                           *agents.flags(1)], env={**os.environ, **agents.env(1)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert tc_programs(c.node(1), "eth0") == {"ingress": [], "egress": []}
    assert not agents.dirs[1][0].exists()
