"""One generator, two uses: `usproxy explain --mode iptables` and the live iptables-save of the
iptables datapath are the same text.

For each of explain's own fixtures (every Service kind, both families, kube-proxy's
TestOverallIPTablesRules), the datapath serves the ServicePorts in a node namespace; explain's
output (the restore input, then the entry jumps as iptables-save lists them) is loaded into an
empty namespace with the same backend; `iptables-save` of both must be the same, table by table
(iptables prints its own normal form, so both texts go through it). The only lines the live
namespace has beyond explain's are the KUBE-PROXY-CANARY chains kube-proxy's monitor keeps, which
explain does not render, and two of usproxy's own, because its ClusterIPs are local addresses:
one jump from filter INPUT to KUBE-SERVICES (jumps.LOCAL_CLUSTER_IPS) and, where nothing else
masquerades it, a node's connection from the ClusterIP itself marked for masquerade
(rules.SERVICE_ADDRESS_SOURCE). They are dropped before comparing.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import categorize
from usproxy.model.local_detector import LocalDetector
from usproxy.model.node import NodeFacts
from usproxy.model.service_set import load_manifests, service_set
from usproxy.model.types import ServicePortName
from usproxy.offload.iptables import nfacct
from usproxy.offload.iptables.backend import Tools
from usproxy.offload.iptables.datapath import IptablesDatapath
from usproxy.offload.iptables.jumps import LOCAL_CLUSTER_IPS
from usproxy.offload.iptables.rules import SERVICE_ADDRESS_SOURCE

from tests.netns import Topology, inside, nsexec, sh
from tests.relay.harness import USPROXY

pytestmark = pytest.mark.netns

FIXTURES = Path(__file__).parents[2] / "explain" / "fixtures"
NODE = "node-a"
CIDRS = ("10.244.0.0/16", "fd00:10:244::/64")


@pytest.fixture
def scratch(topology: Topology) -> Iterator[str]:
    name = topology.ns("scratch")
    sh("ip", "netns", "add", name)
    topology.namespaces.append(name)
    with inside(name):
        assert nfacct.ensure() is None
    yield name


def states(path: Path) -> dict[ServicePortName, ServicePortState]:
    """The ServicePortStates the Proxier hands the datapaths for these manifests on node-a."""
    out = {}
    for sp, eps in service_set(load_manifests(path)).ports:
        cat = categorize(sp, eps, NODE)
        short = cat.cluster_policy if sp.external_traffic_policy == "Local" else ()
        out[sp.name] = ServicePortState(sp, eps, cat.cluster, cat.external, short)
    return out


def explained(path: Path) -> dict[int, str]:
    """explain's restore text per family, comment lines dropped."""
    argv = [USPROXY, "explain", "--services", str(path), "--mode", "iptables", "--node-name", NODE,
            *(f"--cluster-cidr={c}" for c in CIDRS)]
    text = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    out: dict[int, list[str]] = {}
    family = 0
    for line in text.splitlines():
        if line.startswith("# iptables-restore input"):
            family = 4
        elif line.startswith("# ip6tables-restore input"):
            family = 6
        elif line.startswith("===="):  # the next section ("why, in numbers")
            family = 0
        elif family and line and not line.startswith("#"):
            out.setdefault(family, []).append(line)
    return {f: "\n".join(lines) + "\n" for f, lines in out.items()}


def saved(ns: str, tools: Tools, family: int) -> dict[str, list[str]]:
    """iptables-save of filter and nat as lines per table, without counters and canaries."""
    out: dict[str, list[str]] = {}
    for table in ("filter", "nat"):
        text = nsexec(ns, *tools.save(family, table)).stdout  # type: ignore[arg-type]
        out[table] = [line.split(" [")[0] if line.startswith(":") else line for line in text.splitlines()
                      if not line.startswith("#") and "KUBE-PROXY-CANARY" not in line
                      and LOCAL_CLUSTER_IPS.comment not in line and SERVICE_ADDRESS_SOURCE not in line]
    return out


@pytest.mark.parametrize("backend", ["nft", "legacy"])
@pytest.mark.parametrize("fixture", sorted(p.stem for p in FIXTURES.glob("*.yaml")))
async def test_explain_iptables_is_what_the_datapath_holds(topology: Topology, scratch: str, backend: str,
                                                           fixture: str) -> None:
    path = FIXTURES / f"{fixture}.yaml"
    node = NodeFacts(NODE, detector=LocalDetector("ClusterCIDR", tuple(ipaddress.ip_network(c) for c in CIDRS)))
    dp = IptablesDatapath(netns=topology.node, node=node, backend=backend)  # type: ignore[arg-type]
    try:
        assert dp.probe().available
        await dp.read_back()
        wanted = states(path)
        assert all(dp.unsupported(st) is None for st in wanted.values())
        await dp.apply(wanted)
    finally:
        dp.close()
    tools = Tools(backend)  # type: ignore[arg-type]
    for family, text in explained(path).items():
        restore = [tools.command(family, "restore"), "--noflush"]  # type: ignore[arg-type]
        subprocess.run(["ip", "netns", "exec", scratch, *restore], input=text, check=True, text=True)
        assert saved(topology.node, tools, family) == saved(scratch, tools, family), f"IPv{family}"
