"""A packet from the network with a LoadBalancer IP as its source, to that LB IP: kube-proxy's
"same node to LB, SNATted to LB (implicitly allowed)", where a load balancer loops a node's own
connection back to the node (issue 27 item 3). What happens here, and why it cannot complete.

Netns "lb" stands for the load balancer: it owns the LB IP and sends a connection from it to it,
to the node (its own policy routing sends that one flow out). The node holds the LB IP as a local
address on usproxy0, as every datapath here needs (the relay listens there; IPVS mode's
kube-ipvs0 holds it the same way). Found:
- Without `accept_local` on the interface it arrives on, the kernel drops it as a martian (a source
  that is one of the node's own addresses): no datapath sees it.
- With it, nftables DNATs it and masquerades it as kube-proxy would: the endpoint answers, to the
  node's address. conntrack turns the answer's destination back into the LB IP, and the routing
  decision for that address is `local`: the answer is delivered to the node itself (whose stack,
  knowing no such connection, resets it), not sent back to the load balancer, so the connection
  never completes. The relay meets the same route for its
  SYN-ACK. kube-proxy's iptables and nftables modes do not hold LB IPs as local addresses and route
  the answer out; its IPVS mode has this very limitation (Kubernetes' answer is `ipMode: Proxy`,
  which usproxy honours: such an LB IP is not served on the node at all). Closing it needs the LB
  IPs out of the `local` table (local routes in a table of their own behind policy rules, with
  IP_FREEBIND listeners) or the `local` rule moved behind a mark rule; README "Differences".
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
NODE_SIDE, LB_SIDE = "10.255.255.1", "10.255.255.2"


def load_balancer(topo: Topology) -> tuple[str, str]:
    """Netns "lb" on a /30 link to the node; (its netns, the node's interface to it). Its own
    connection from the LB IP to the LB IP leaves to the node (the `local` rule moved behind a
    rule for that flow); answers to the LB IP coming back from the node are local there."""
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
                ["ip", "rule", "add", "pref", "100", "lookup", "local"], ["ip", "rule", "del", "pref", "0"],
                ["ip", "rule", "add", "pref", "10", "iif", "lo", "from", LB_IP, "to", LB_IP, "lookup", "200"],
                ["ip", "route", "add", "default", "via", NODE_SIDE, "table", "200"]):
        nsexec(lb, *cmd)
    return lb, dev


def hairpin(lb: str) -> str:
    with inside(lb):
        s = socket.socket()
    s.settimeout(1.5)
    try:
        s.bind((LB_IP, 0))
        s.connect((LB_IP, 80))
        return s.recv(64).decode().split()[0]
    except OSError as err:
        return type(err).__name__
    finally:
        s.close()


def test_the_answer_is_routed_to_the_node_itself(topology: Topology, tmp_path: Path) -> None:
    pods = Pods(topology, tmp_path)
    m = Manifests(tmp_path / "m")
    web = svc("web", "10.96.10.10", [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
              type="LoadBalancer")
    web["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    m.write(web, slice_("web", [{"ip": ENDPOINT, "ready": True}], [{"name": "http", "port": 8080, "protocol": "TCP"}]))
    agent = AgentProc(topology, m, "uvloop", *OFFLOAD)
    try:
        pods.add("web", ENDPOINT)
        lb, dev = load_balancer(topology)
        wait_listening(topology.node, ENDPOINT, 8080)
        agent.start()
        for _ in range(100):
            if any(r["datapath"] == "nftables" for r in agent.services()):
                break
            time.sleep(0.1)
        node = topology.node
        assert hairpin(lb) == "TimeoutError"  # a martian: dropped before any datapath
        assert f"src={LB_IP} dst={LB_IP}" not in conntrack(node)
        nsexec(node, "sysctl", "-qw", f"net.ipv4.conf.{dev}.accept_local=1")
        assert hairpin(lb) == "TimeoutError"  # in, DNATed and masqueraded, but the answer never leaves
        entries = [e for e in conntrack(node).splitlines() if f"src={LB_IP} dst={LB_IP}" in e]
        assert entries and all(f"src={ENDPOINT} dst=10.244.0.1 sport=8080" in e for e in entries), entries
        answered = [int(re.search(r"src=\S+ dst=10\.244\.0\.1 sport=8080 dport=\d+ packets=(\d+)", e).group(1))  # type: ignore[union-attr]
                    for e in entries]
        assert all(n >= 1 for n in answered), entries  # the endpoint answered, to the node's address
        route = nsexec(node, "ip", "route", "get", LB_IP, "from", ENDPOINT, "iif", "usbr0").stdout
        assert route.startswith(f"local {LB_IP} ") and " dev lo " in route, route  # to the node itself
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()
