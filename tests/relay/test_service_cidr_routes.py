"""Unallocated Service CIDR addresses on a node without the nftables datapath (service_cidr_routes.py),
real traffic on both event loops.

The node routes the Service CIDR somewhere (netns "world", which answers every packet with ICMP
unreachable), as a node whose default route covers it would send it on. With `--offload none`
and `--service-cidr`, a pod's connection to an unallocated address of the CIDR gets no answer at
all (dropped, as kube-proxy's "Drop traffic to unallocated ClusterIPs"), while an allocated
ClusterIP answers; the routes follow a ServiceCIDR object added to the manifests; `usproxy run
--cleanup` removes them, and an agent whose nftables datapath checks the CIDRs installs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec, sh
from tests.offload.harness import Pods, tcp_name, wait_listening
from tests.relay.harness import USPROXY, AgentProc, Manifests, slice_, svc
from usproxy.relay.service_cidr_routes import RULE_PRIORITY, TABLE

pytestmark = pytest.mark.netns

PORTS = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]


def objects(extra_cidr: str | None = None) -> list[dict[str, Any]]:
    out = [svc("web", "10.96.10.10", PORTS),
           slice_("web", [{"ip": "10.244.1.5", "ready": True}], [{"name": "http", "port": 8080, "protocol": "TCP"}])]
    if extra_cidr:
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "extra"},
                    "spec": {"cidrs": [extra_cidr]}})
    return out


def outcome(ns: str, addr: str) -> str:
    try:
        return tcp_name(ns, addr, 80, timeout=1.5)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return err.strerror or "error"


def world(topo: Topology) -> None:
    """Route 10.96.0.0/14 (the CIDR, the extra one and one outside both) to netns "world", which refuses it all."""
    name = topo.ns("world")
    sh("ip", "netns", "add", name)
    topo.namespaces.append(name)
    dev = f"{topo.prefix[-6:]}w"
    nsexec(topo.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", name)
    nsexec(topo.node, "ip", "addr", "add", "10.255.255.1/30", "dev", dev)
    nsexec(topo.node, "ip", "link", "set", dev, "up")
    nsexec(topo.node, "ip", "route", "add", "10.96.0.0/14", "via", "10.255.255.2")
    nsexec(name, "ip", "addr", "add", "10.255.255.2/30", "dev", "eth0")
    nsexec(name, "ip", "link", "set", "eth0", "up")
    nsexec(name, "ip", "route", "add", "10.244.0.0/16", "via", "10.255.255.1")
    nsexec(name, "ip", "route", "add", "unreachable", "10.96.0.0/14")
    nsexec(name, "sysctl", "-qw", "net.ipv4.ip_forward=1")


def routes(topo: Topology) -> tuple[str, str]:
    rules = nsexec(topo.node, "ip", "rule", "show", "pref", str(RULE_PRIORITY)).stdout.strip()
    table = nsexec(topo.node, "ip", "route", "show", "table", str(TABLE), check=False).stdout
    return rules, "\n".join(" ".join(line.split()[:2]) for line in table.splitlines())  # "blackhole CIDR"


def test_unallocated_addresses_dropped_allocated_served(topology: Topology, tmp_path: Path, loop_name: str) -> None:
    pods = Pods(topology, tmp_path)
    world(topology)
    m = Manifests(tmp_path / "m")
    m.write(*objects())
    agent = AgentProc(topology, m, loop_name, "--service-cidr", "10.96.0.0/16")
    try:
        pods.add("web", "10.244.1.5")
        client = topology.add_host("client", "10.244.9.20")
        wait_listening(client, "10.244.1.5", 8080)
        assert outcome(client, "10.96.10.99") == "No route to host"  # before: routed on to "world"
        agent.start()
        assert outcome(client, "10.96.10.10") == "web"  # allocated: served
        assert outcome(client, "10.96.10.99") == "timeout"  # unallocated: dropped, no answer
        assert outcome(client, "10.98.0.5") == "No route to host"  # not (yet) a Service CIDR: routed on
        rules, table = routes(topology)
        assert f"lookup {TABLE}" in rules and table == "blackhole 10.96.0.0/16", (rules, table)

        agent.wait_synced_after(m.write(*objects("10.98.0.0/16")))  # a ServiceCIDR object adds one
        assert outcome(client, "10.98.0.5") == "timeout"
        assert routes(topology)[1].splitlines() == ["blackhole 10.96.0.0/16", "blackhole 10.98.0.0/16"]
        agent.stop()
        assert outcome(client, "10.96.10.99") == "timeout"  # kept while the agent is down, as usproxy0

        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        assert routes(topology) == ("", "")
        assert outcome(client, "10.96.10.99") == "No route to host"

        nft = AgentProc(topology, m, loop_name, "--service-cidr", "10.96.0.0/16", "--offload", "nftables")
        agent = nft
        nft.start()
        assert routes(topology) == ("", "")  # nftables drops them itself (cluster-ips-check)
    finally:
        agent.stop()
        nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        pods.close()
