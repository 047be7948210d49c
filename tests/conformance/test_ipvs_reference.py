"""kube-proxy's IPVS expectations (tests/conformance/ipvs_reference.py) against usproxy.

Here, on any machine: the generator the IPVS datapath installs (offload/ipvs/rules.py, the one
`usproxy explain --mode ipvs` prints) holds every expectation: the virtual servers and their real
servers (and persistence), the ipset entries, the iptables rules' jump targets and matched sets in
order, kube-ipvs0's addresses.

In the VM lab's ipvs guest (skipped elsewhere: this project's machines have no IPVS): every
expected virtual server with real servers is replayed as real traffic through the IPVS datapath in
a throwaway node namespace: new connections (or datagrams) to its address and port are answered by
exactly the expected endpoints (pods at `pod_address` of kube-proxy's endpoint addresses), and one
without real servers is refused. Skipped there: the 127.0.0.1 externalIP of TestExternalIPs
(another namespace cannot address the node's loopback) and the cases whose virtual servers have no
expectation on real servers (TestLoadBalancer's endpoint slice names UDP for a TCP Service, so its
checkIPVS compares nothing; TestHealthCheckNodePort, TestAcceptIPVSTraffic and
TestMultiPortServiceBindAddr check sets and rules only).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from usproxy.model.node import NodeFacts
from usproxy.model.service_set import Node
from usproxy.offload.iptables.family_ports import family_port_of
from usproxy.offload.ipvs import rules
from usproxy.offload.ipvs.datapath import IpvsDatapath

from tests.conformance.ipvs_reference import CASES, NODE, Case, Vs, pod_address
from tests.netns import Topology, inside, nsexec
from tests.offload.harness import Pods, tcp_name, wait_listening
from tests.offload.ipvs.guest import NEEDS_IPVS

IP = ipaddress.ip_address


@pytest.fixture
def pods(topology: Topology, tmp_path: Path) -> Iterator[Pods]:
    p = Pods(topology, tmp_path)
    try:
        yield p
    finally:
        p.close()


def generated(case: Case) -> rules.Tables:
    node_ips = tuple(IP(a) for a in case.node_ips)
    fps = [fp for st in case.states().values() if (fp := family_port_of(st, 4)) is not None]
    return rules.tables(fps, Node(NODE, node_ips), 4, node_ips)


def servers(t: rules.Tables) -> dict[tuple[str, str, int], tuple[tuple[str, ...], int]]:
    return {(k[0], str(k[1]), k[2]): (tuple(sorted(str(e) for e in vs.reals)), vs.persistent or 0)
            for k, vs in t.servers().items()}


def chain_rules(t: rules.Tables, chain: str) -> list[tuple[str, str]]:
    """(jump, matched set) of each rule of `chain`, its nat table's then its filter table's, as
    kube-proxy's checkIptables reads them."""
    out = []
    for table in t.restore_input().split("COMMIT"):
        for line in table.splitlines():
            words = line.split()
            if words[:2] == ["-A", chain]:
                match = words[words.index("--match-set") + 1] if "--match-set" in words else ""
                out.append((words[words.index("-j") + 1], match))
    return out


def expected(vs: Vs) -> tuple[tuple[str, str, int], tuple[str, ...] | None, int]:
    return (vs.proto, vs.addr, vs.port), tuple(sorted(vs.reals)) if vs.reals is not None else None, vs.persistent


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_the_generator_holds_kube_proxys_expectations(case: Case) -> None:
    t = generated(case)
    got = servers(t)
    if case.servers is not None:
        assert set(got) == {expected(v)[0] for v in case.servers}, case.test
    if case.server_count is not None:
        assert len(got) == case.server_count, case.test
    for vs in (*(case.servers or ()), *case.servers_some):
        key, reals, persistent = expected(vs)
        assert key in got, (case.test, key)
        if reals is not None:
            assert got[key][0] == reals, (case.test, key)
        assert got[key][1] == persistent, (case.test, key)
    for name, entries in case.sets.items():
        assert sorted(t.entries[name]) == sorted(entries), (case.test, name)
    for chain, want in case.chains.items():
        assert chain_rules(t, chain) == [(r.jump, r.match_set) for r in want], (case.test, chain)
    if case.bound is not None:
        assert sorted(map(str, t.bound)) == sorted(case.bound), case.test


# -- as traffic, in the VM lab ----------------------------------------------------------------------
def replayed(case: Case) -> list[Vs]:
    """The case's virtual servers with an expectation on real servers that traffic can check."""
    out = [v for v in (*(case.servers or ()), *case.servers_some) if v.reals is not None and v.addr != "127.0.0.1"]
    return out


def pod_name(ip: str) -> str:
    return "ep-" + pod_address(ip).replace(".", "-")


def mapped(case: Case) -> Case:
    """The case with its endpoints at their pod addresses."""
    return replace(case, endpoints=tuple(replace(e, ip=pod_address(e.ip)) for e in case.endpoints))


def answers(cli: str, vs: Vs, attempts: int) -> set[str]:
    """Which pods answer `attempts` new connections (or one-datagram exchanges) to `vs`."""
    seen = set()
    for _ in range(attempts):
        if vs.proto == "TCP":
            seen.add(tcp_name(cli, vs.addr, vs.port))
            continue
        with inside(cli):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        try:
            s.connect((vs.addr, vs.port))
            s.send(b"q")
            seen.add(s.recv(512).split(b"|")[0].decode())
        finally:
            s.close()
    return seen


@pytest.mark.netns
@NEEDS_IPVS
@pytest.mark.parametrize("case", [c for c in CASES if replayed(c)], ids=lambda c: c.key)
async def test_kube_proxys_virtual_servers_as_traffic(topology: Topology, pods: Pods, case: Case) -> None:
    for e in {e.ip for e in case.endpoints}:
        pods.add(pod_name(e), pod_address(e), port=80)
    cli = topology.add_host("cli", "10.244.9.10")
    for e in {e.ip for e in case.endpoints}:
        wait_listening(cli, pod_address(e), 80)
    for a in case.node_ips:
        nsexec(topology.node, "ip", "addr", "add", f"{a}/32", "dev", "usbr0")
    # NodePorts on the fake proxier's node addresses only (none when it has none)
    cidrs = tuple(ipaddress.ip_network(f"{a}/32") for a in case.node_ips) or (ipaddress.ip_network("198.51.100.254/32"),)
    dp = IpvsDatapath(netns=topology.node, node=NodeFacts(NODE, cidrs), node_ips=lambda: [IP(a) for a in case.node_ips])
    try:
        await dp.apply(mapped(case).states())
        for vs in replayed(case):
            want = {pod_name(r.rsplit(":", 1)[0]) for r in vs.reals or ()}
            if not want:
                with pytest.raises(ConnectionRefusedError):
                    answers(cli, vs, 1)
                continue
            assert answers(cli, vs, 4 * len(want) + 2) == want, (case.test, vs)
    finally:
        dp.close()
