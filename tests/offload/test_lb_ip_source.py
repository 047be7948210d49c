"""A packet from the network with a LoadBalancer IP as its source, to that LB IP: kube-proxy's
"same node to LB, SNATted to LB (implicitly allowed)", where a load balancer loops a node's own
connection back to the node (issue 27 item 3). It completes, answered by an endpoint that sees a
node address, in the relay and in the nftables datapath (and in iptables, by the same means).

Netns "lb" stands for the load balancer: it owns the LB IP and sends a connection from it to it,
to the node (its own policy routing sends that one flow out). The node holds the LB IP as a local
address on usproxy0 (the relay listens there), which stood in the way twice (found here first,
with the agent's pieces applied by hand one at a time; each is necessary):
- without `accept_local` the kernel drops the packet as a martian (a source that is one of the
  node's own addresses): no datapath sees it;
- with it, nftables DNATs and masquerades it and the endpoint answers, but conntrack turns the
  answer's destination back into the LB IP, which table `local` makes the node's own: the answer
  was delivered to the node itself (which reset it), never sent back to the load balancer; the
  relay's SYN-ACK met the same route.
The agent now sets accept_local, marks the connections that arrive from the network with a local
source and their answers (table `ip usproxy-return`), and routes marked answers by `main` ahead
of `local` (usproxy/relay/return_route.py). The load balancer side needs accept_local too: the
answer reaches it with its own address as the source.

test_hairpin_completes fails on the old code (TimeoutError: the martian drop).
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from tests.netns import Topology, inside, nsexec, sh
from tests.offload.harness import OFFLOAD, Pods, conntrack, wait_listening
from tests.relay.harness import USPROXY, AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

LB_IP, ENDPOINT = "198.51.100.1", "10.244.1.5"
MARK = 0x1000  # --hairpin-mark: hairpins are off unless it is given
NODE_SIDE, LB_SIDE = "10.255.255.1", "10.255.255.2"


def load_balancer(topo: Topology) -> tuple[str, str]:
    """Netns "lb" on a /30 link to the node; (its netns, the node's interface to it). Its own
    connection from the LB IP to the LB IP leaves to the node (the `local` rule moved behind a
    rule for that flow); answers to the LB IP coming back from the node are local there (with
    accept_local: their source is the LB IP too)."""
    lb = topo.ns("lb")
    sh("ip", "netns", "add", lb)
    topo.namespaces.append(lb)
    dev = f"{topo.prefix[-6:]}l"
    nsexec(topo.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", lb)
    nsexec(topo.node, "ip", "addr", "add", f"{NODE_SIDE}/30", "dev", dev)
    nsexec(topo.node, "ip", "link", "set", dev, "up")
    nsexec(topo.node, "ip", "route", "add", "198.51.100.0/24", "via", LB_SIDE)
    for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{LB_SIDE}/30", "dev", "eth0"],
                ["ip", "link", "set", "eth0", "up"], ["ip", "addr", "add", f"{LB_IP}/32", "dev", "lo"],
                ["ip", "route", "add", "10.244.0.0/16", "via", NODE_SIDE],
                ["sysctl", "-qw", "net.ipv4.conf.eth0.accept_local=1"],
                ["ip", "rule", "add", "pref", "100", "lookup", "local"], ["ip", "rule", "del", "pref", "0"],
                ["ip", "rule", "add", "pref", "10", "iif", "lo", "from", LB_IP, "to", LB_IP, "lookup", "200"],
                ["ip", "route", "add", "default", "via", NODE_SIDE, "table", "200"]):
        nsexec(lb, *cmd)
    return lb, dev


def connect(ns: str, src: str | None = None) -> socket.socket:
    """A TCP connection from `ns` (bound to `src`) to the LB IP's port 80."""
    with inside(ns):
        s = socket.socket()
    s.settimeout(3.0)
    try:
        if src:
            s.bind((src, 0))
        s.connect((LB_IP, 80))
    except OSError:
        s.close()
        raise
    return s


def greeting(s: socket.socket) -> tuple[str, str]:
    """(endpoint name, the peer address the endpoint saw) from idsrv's first line."""
    name, peer = s.recv(128).decode().split()[:2]
    return name, peer


def echoes(s: socket.socket) -> bool:
    try:
        s.sendall(b"ping\n")
        return s.recv(64) == b"ping\n"
    except OSError:
        return False


def accept_local(ns: str) -> str:
    return nsexec(ns, "sysctl", "-n", "net.ipv4.conf.all.accept_local").stdout.strip()


def node_addresses(node: str) -> set[str]:
    """The node's IPv4 addresses on its own interfaces (not usproxy0's Service addresses)."""
    out = nsexec(node, "ip", "-4", "-o", "addr", "show").stdout
    return {f.split()[3].split("/")[0] for f in out.splitlines() if f.split()[1] not in ("usproxy0", "lo")}


def start(topology: Topology, tmp_path: Path, datapath: str, loop: str,
          flags: tuple[str, ...] = (), local_policy: bool = False) -> tuple[Pods, AgentProc, str]:
    """The endpoint, the load balancer netns and the agent; `datapath`: "relay" (--offload none),
    a kernel datapath ("nftables", "iptables": returns once it serves the Service), or
    "relay-first" (`flags`, returns while the relay still serves it). `local_policy`: the Service
    has externalTrafficPolicy Local and its endpoint is on another node. Returns (pods, agent, lb
    netns)."""
    pods = Pods(topology, tmp_path)
    m = Manifests(tmp_path / "m")
    web = svc("web", "10.96.10.10", [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                                     {"name": "dns", "port": 80, "targetPort": 8080, "protocol": "UDP"}],
              type="LoadBalancer")
    web["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    endpoint = {"ip": ENDPOINT, "ready": True}
    if local_policy:
        web["spec"]["externalTrafficPolicy"] = "Local"
        endpoint["nodeName"] = "another-node"
    m.write(web, slice_("web", [endpoint], [{"name": "http", "port": 8080, "protocol": "TCP"},
                                            {"name": "dns", "port": 8080, "protocol": "UDP"}]))
    kernel = datapath not in ("relay", "relay-first")
    if kernel:
        flags = ("--offload", datapath, *OFFLOAD[2:])
    agent = AgentProc(topology, m, loop, *flags, "--hairpin-mark", f"{MARK:#x}")
    pods.add("web", ENDPOINT)
    lb, _ = load_balancer(topology)
    wait_listening(topology.node, ENDPOINT, 8080)
    agent.start()
    deadline = time.monotonic() + 15
    while kernel and not all(r["datapath"] == datapath for r in agent.services()):
        assert time.monotonic() < deadline, agent.services()
        time.sleep(0.1)
    return pods, agent, lb


CASES = [("relay", "asyncio"), ("relay", "uvloop"), ("nftables", "asyncio"), ("nftables", "uvloop"),
         ("iptables", "uvloop")]


@pytest.mark.parametrize(("datapath", "loop"), CASES)
def test_hairpin_completes(topology: Topology, tmp_path: Path, datapath: str, loop: str) -> None:
    """The hairpinned connection is answered by the endpoint, which sees a node address; ordinary
    clients of the LB IP (a pod's, and the node's own, bound to the LB IP or not) still are. A
    packet from the network with one of the node's real addresses as its source stays dropped,
    to the node and through it.
    In a kernel datapath the kernel carries it (conntrack shows the DNAT and the masquerade)."""
    pods, agent, lb = start(topology, tmp_path, datapath, loop)
    node = topology.node
    try:
        with connect(lb, LB_IP) as s:
            name, peer = greeting(s)
            assert name == "web" and echoes(s)
        assert peer in node_addresses(node) and peer != LB_IP, peer  # masqueraded
        if datapath != "relay":
            entries = [e for e in conntrack(node).splitlines() if f"src={LB_IP} dst={LB_IP}" in e]
            assert entries and all(f"src={ENDPOINT} dst={peer} sport=8080" in e for e in entries), entries
        spoofed = topology.node_addresses[0]  # one of the node's real addresses as the source:
        nsexec(lb, "ip", "addr", "add", f"{spoofed}/32", "dev", "lo")  # still a martian, dropped
        nsexec(lb, "ip", "rule", "add", "pref", "11", "iif", "lo", "from", spoofed, "to", LB_IP, "lookup", "200")
        with pytest.raises(TimeoutError):
            connect(lb, spoofed).close()
        assert f"src={spoofed} dst={LB_IP}" not in conntrack(node)  # neither relayed nor DNATed
        with pytest.raises(OSError):  # nor forwarded through the node (a martian without accept_local)
            with inside(lb):
                socket.create_connection((ENDPOINT, 8080), timeout=1.0, source_address=(spoofed, 0)).close()
        assert f"src={spoofed} dst={ENDPOINT}" not in conntrack(node)
        client = topology.add_host("client", "10.244.2.7")
        for ns, src in ((client, None), (node, None), (node, LB_IP)):  # not hairpins: unchanged
            with connect(ns, src) as s:
                assert greeting(s)[0] == "web" and echoes(s), (ns, src)
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()


def test_hairpin_outlives_an_agent_restart_and_cleanup_restores_local(topology: Topology, tmp_path: Path) -> None:
    """nftables: a hairpinned connection keeps talking while the agent restarts (its conntrack
    mark, the rules and table usproxy-return stay); `run --cleanup` takes them back and puts the
    `local` rule back at priority 0."""
    pods, agent, lb = start(topology, tmp_path, "nftables", "uvloop")
    node = topology.node
    try:
        rules = nsexec(node, "ip", "rule").stdout
        assert "fwmark 0x1000/0x1000 lookup main" in rules and not re.search(r"^0:\s+from all lookup local", rules, re.M)
        with connect(lb, LB_IP) as s:
            assert greeting(s)[0] == "web"
            agent.stop()
            assert echoes(s)
            agent.start()
            assert echoes(s)
            with connect(lb, LB_IP) as again:
                assert greeting(again)[0] == "web"
        agent.stop()
        assert nsexec(node, USPROXY, "run", "--cleanup", check=False).returncode == 0
        rules = nsexec(node, "ip", "rule").stdout
        assert re.search(r"^0:\s+from all lookup local", rules, re.M) and "proto 67" not in rules, rules
        assert "usproxy-return" not in nsexec(node, "nft", "list", "tables").stdout
        assert accept_local(node) == "0"  # without the table's drop, no martian check is left
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()


def test_hairpin_mark_0_turns_it_off_and_takes_an_earlier_agents_rules_back(topology: Topology,
                                                                            tmp_path: Path) -> None:
    """`--hairpin-mark 0` (a node whose other programs use every free mark bit): the agent
    restarted with it removes table usproxy-return and its policy rules (`local` back at 0), so a
    hairpinned connection is no longer served; every other client still is."""
    pods, agent, lb = start(topology, tmp_path, "nftables", "uvloop")
    node = topology.node
    off = AgentProc(topology, agent.manifests, "uvloop", *agent.extra, "--hairpin-mark", "0")
    try:
        with connect(lb, LB_IP) as s:
            assert greeting(s)[0] == "web"
        assert accept_local(node) == "1"
        agent.stop()
        off.start()
        rules = nsexec(node, "ip", "rule").stdout
        assert re.search(r"^0:\s+from all lookup local", rules, re.M) and "proto 67" not in rules, rules
        assert "usproxy-return" not in nsexec(node, "nft", "list", "tables").stdout
        assert accept_local(node) == "0"  # without the table's drop, no martian check is left
        with pytest.raises(OSError):
            connect(lb, LB_IP).close()
        with connect(node) as s:
            assert greeting(s)[0] == "web" and echoes(s)
    finally:
        off.stop()
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()


def test_hairpin_outlives_the_move_from_relay_to_nftables(topology: Topology, tmp_path: Path) -> None:
    """A hairpinned connection the relay accepted keeps talking after nftables takes the Service
    over (the relay keeps its flows), and the next one is the kernel's."""
    flags = ("--offload", "nftables", "--offload-after", "5", "--min-sync-period", "200ms")
    pods, agent, lb = start(topology, tmp_path, "relay-first", "uvloop", flags)
    node = topology.node
    try:
        with connect(lb, LB_IP) as s:
            assert greeting(s)[0] == "web"
            assert all(r["datapath"] != "nftables" for r in agent.services())  # the relay's
            deadline = time.monotonic() + 30
            while not any(r["datapath"] == "nftables" for r in agent.services()):
                assert time.monotonic() < deadline, agent.services()
                time.sleep(0.2)
            assert echoes(s)
            with connect(lb, LB_IP) as again:
                assert greeting(again)[0] == "web" and echoes(again)
            assert echoes(s)
        entries = [e for e in conntrack(node).splitlines() if f"src={LB_IP} dst={LB_IP}" in e]
        assert any(f"src={ENDPOINT} " in e for e in entries), entries  # the second: DNATed by the kernel
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()
