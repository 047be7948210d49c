"""Live flows across every transition after the first offload: demotion and re-promotion, an
endpoint added and removed, an agent restart (SIGTERM and kill -9) and `usproxy run --cleanup`.
Long-lived TCP talkers (a line every 250 ms, echoed) and UDP sessions (a query every 100 ms on
one connected socket) keep talking across each; the first offload itself is test_live_flows.py,
`--offload bpf` promotion tests/offload/bpf/test_live_flows.py.

What must hold (README, "Kernel offload", "Live flows at the handover"):
- demotion: a kernel-carried flow keeps its conntrack entry (and its NAT) after its ServicePort
  leaves the kernel, so it runs on; re-promotion: flows the relay took meanwhile stay with it.
- an endpoint added or removed leaves every other endpoint's flows alone; flows to a removed
  endpoint as kube-proxy: TCP runs on (its entry stays), UDP entries are deleted so the session's
  next datagram picks a remaining endpoint (pkg/proxy/conntrack CleanStaleEntries).
- an agent restart, whatever the signal, leaves kernel flows alone (the table is read back, not
  flushed); the relay's own flows end with its process.
- `--cleanup` deletes the tables: kernel flows run on only where another nat table uses
  conntrack (a CNI's masquerade), else they end; measured here, so the README can say so.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec
from tests.offload.agent import datapath_of, wait_for
from tests.offload.harness import Pods, tcp_name, tcp_peer_name, wait_listening
from tests.offload.live_flows import (EPS, VIP, TcpTalker, UdpSession, annotated, counts, finish, kept, one_endpoint,
                                      services, start_pods, talk)
from tests.relay.harness import USPROXY, AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

WEB, DNS, PINNED = "default/web:http", "default/dns:dns", "default/pinned:http"
PINNED_VIP = "10.96.10.40"
# what a node's CNI masquerade or iptables-nft nat table provides: nat hooks and a conntrack user
OTHER_NAT = """table ip other {
  chain pre { type nat hook prerouting priority -90; ct state new counter; }
  chain post { type nat hook postrouting priority 90; ct state new counter; }
}
"""
FLAGS = ("--offload", "nftables", "--offload-after", "1", "--min-sync-period", "100ms")



def pinned() -> list[dict[str, Any]]:
    """A TCP and a UDP port of a Service the relay keeps (annotation usproxy.io/datapath=userspace)."""
    eps = [{"ip": e, "ready": True} for e in EPS]
    ports = [{"name": "http", "port": 80, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"}]
    return annotated([svc("pinned", PINNED_VIP, [{**p, "targetPort": 8080} for p in ports]),
                      slice_("pinned", eps, [{**p, "port": 8080} for p in ports])], "userspace")


def offloaded(agent: AgentProc, *names: str) -> bool:
    return all(datapath_of(agent, n) == "nftables" for n in names)


def start_agent(topology: Topology, m: Manifests, node: str, *extra: dict[str, Any], loop: str = "uvloop") -> AgentProc:
    """An agent serving web and dns (and `extra`) from the kernel; on a warm node the table held
    `other` before they were known."""
    agent = AgentProc(topology, m, loop, *FLAGS)
    if node == "warm":
        m.write(*services(other=True)[4:])
        agent.start()
        wait_for(lambda: offloaded(agent, "default/other:http"), 10, "other offloaded")
        m.write(*services(other=True), *extra)
    else:
        m.write(*services(), *extra)
        agent.start()
    wait_for(lambda: offloaded(agent, WEB, DNS), 10, "web and dns offloaded")
    return agent







@pytest.mark.parametrize(("node", "loop"), [("fresh", "uvloop"), ("warm", "asyncio")])
def test_demotion_and_repromotion_keep_every_flow(topology: Topology, tmp_path: Path, pods: Pods, node: str,
                                                  loop: str) -> None:
    """Kernel flows run on after their ServicePort is demoted (their conntrack entries keep the
    NAT); flows the relay took during the demotion stay with it after re-promotion."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start_agent(topology, m, node, loop=loop)
    extra = services(other=True)[4:] if node == "warm" else []
    try:
        k_tcp, k_udp = talk(cli, 6, 3)
        time.sleep(0.5)
        m.write(*annotated(services(), "userspace"), *extra)
        wait_for(lambda: datapath_of(agent, WEB) == datapath_of(agent, DNS) == "userspace", 10, "demotion")
        t_demoted, before = time.monotonic(), counts(k_tcp)
        r_tcp, r_udp = talk(cli, 6, 3)
        time.sleep(1)
        # /flows lists both: the flows the relay took and the kernel's, which run on their entries
        listed = Counter((f["datapath"], f["service"], f["state"] if f["protocol"] == "TCP" else "")
                         for f in agent.flows())  # (a UDP entry is ASSURED only after 2 s)
        for datapath in ("userspace", "nftables"):
            assert listed[(datapath, "default/web:http/TCP", "ESTABLISHED")] == 6, listed
            assert listed[(datapath, "default/dns:dns/UDP", "")] == 3, listed
        m.write(*services(), *extra)
        wait_for(lambda: offloaded(agent, WEB, DNS), 10, "re-promotion")
        t_promoted, r_before = time.monotonic(), counts(r_tcp)
        time.sleep(1.5)
        assert tcp_peer_name(cli, VIP, 80)[1] == "10.244.9.10"  # new connections: the kernel again
        finish(k_tcp + r_tcp, k_udp + r_udp)
        kept(k_tcp, before, 8)
        kept(r_tcp, r_before, 4)
        one_endpoint(k_udp, t_demoted, 20)
        one_endpoint(r_udp, t_promoted, 10)
    finally:
        agent.stop()


def cover(make: Any, endpoint: Any, want: int, cap: int) -> list[Any]:
    """Talkers from `make()` until every endpoint has one (at least `want`, at most `cap`)."""
    out: list[Any] = []
    while len(out) < want or len({endpoint(t) for t in out}) < len(EPS):
        assert len(out) < cap, Counter(endpoint(t) for t in out)
        out.append(make())
    return out


def first_answer(s: UdpSession) -> str:
    wait_for(lambda: bool(s.answers), 3, "a UDP answer")
    return s.answers[0][1]


def test_endpoint_add_and_remove(topology: Topology, tmp_path: Path, pods: Pods) -> None:
    """Adding and removing an endpoint leaves the others' flows alone; after removing an endpoint
    that carries flows, its TCP connections run on and its UDP sessions move (kube-proxy)."""
    cli = start_pods(topology, pods)
    pods.add("be-3", "10.244.4.5")
    wait_listening(cli, "10.244.4.5", 8080)
    m = Manifests(tmp_path / "m")
    agent = start_agent(topology, m, "fresh")

    def with_endpoints(ips: list[str]) -> None:
        objs = services()
        objs[3] = slice_("dns", [{"ip": e, "ready": True} for e in ips], [{"name": "dns", "port": 8080, "protocol": "UDP"}])
        objs[1] = slice_("web", [{"ip": e, "ready": True} for e in ips], [{"name": "http", "port": 8080, "protocol": "TCP"}])
        m.write(*objs)

    def started(s: UdpSession) -> UdpSession:
        s.start()
        return s

    try:
        tcp = cover(lambda: TcpTalker(cli), lambda t: t.endpoint, 9, 40)
        udp = cover(lambda: started(UdpSession(cli)), first_answer, 6, 30)
        for t in tcp:
            t.start()
        names = {first_answer(s) for s in udp}
        assert names == {"be-0", "be-1", "be-2"}
        t0 = time.monotonic()
        with_endpoints([*EPS, "10.244.4.5"])
        agent.wait_synced_after(t0)
        time.sleep(0.7)
        t1 = time.monotonic()
        with_endpoints(EPS)
        agent.wait_synced_after(t1)
        time.sleep(0.7)
        one_endpoint(udp, t0, 5)  # an unused endpoint came and went: nothing moved
        t2, before = time.monotonic(), counts(tcp)
        with_endpoints(EPS[1:])  # be-0 leaves the slices; its pod keeps serving its connections
        agent.wait_synced_after(t2)
        time.sleep(1.5)
        finish(tcp, udp)
        kept(tcp, before, 4)  # be-0's TCP connections too: their conntrack entries stay
        for s in udp:
            after = {name for at, name in s.answers if at > t2 + 0.3}
            if s.answers[0][1] == "be-0":
                assert len(after) == 1 and after != {"be-0"}, s.answers  # moved once, then kept
            else:
                assert {name for _, name in s.answers} == {s.answers[0][1]}, s.answers
    finally:
        agent.stop()


@pytest.mark.parametrize("node", ["fresh", "warm"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_agent_restart_keeps_kernel_flows(topology: Topology, tmp_path: Path, pods: Pods, node: str,
                                          sig: signal.Signals) -> None:
    """Kernel flows keep talking while the agent is down and after it has read the table back;
    the relay's connections end with its process (SIGTERM resets them; after kill -9 the kernel
    closes a dead process's sockets); a relayed UDP session is answered again once it is back."""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start_agent(topology, m, node, *pinned())
    try:
        k_tcp, k_udp = talk(cli, 6, 3)
        r_tcp, _ = talk(cli, 3, 0, addr=(PINNED_VIP, 80))
        r_udp = [UdpSession(cli, addr=(PINNED_VIP, 53)) for _ in range(2)]
        for s in r_udp:
            s.start()
        time.sleep(0.5)
        t_down, before = time.monotonic(), counts(k_tcp)
        agent.stop(sig)
        time.sleep(1.5)
        kept(k_tcp, before, 4)  # while no agent runs
        assert all(t.errors for t in r_tcp), [t.errors for t in r_tcp]
        agent.start()
        wait_for(lambda: offloaded(agent, WEB, DNS), 10, "read back")
        t_up = time.monotonic()
        since_restart = agent.log.read_text().split("kernel datapath nftables")[-1]
        assert f"read back {3 if node == 'warm' else 2} ServicePorts from nftables" in since_restart
        before = counts(k_tcp)
        time.sleep(1)
        assert tcp_name(cli, PINNED_VIP, 80) in {"be-0", "be-1", "be-2"}  # the relay serves again
        rows = Counter((f["service"], f["state"]) for f in agent.flows() if f["datapath"] == "nftables")
        finish(k_tcp + r_tcp, k_udp + r_udp)
        kept(k_tcp, before, 3)
        one_endpoint(k_udp, t_down, 20)
        # a relayed UDP session's socket is served again by the new relay, as a new flow
        assert all(len([a for a in s.answers if a[0] > t_up]) >= 5 for s in r_udp), [s.answers[-3:] for s in r_udp]
        # the restarted agent lists the flows the kernel carried through its absence
        assert rows[("default/web:http/TCP", "ESTABLISHED")] == 6 and rows[("default/dns:dns/UDP", "ASSURED")] == 3, rows
    finally:
        agent.stop()


@pytest.mark.parametrize("node", ["usproxy-alone", "other-nat-table"])
def test_cleanup_with_kernel_flows_open(topology: Topology, tmp_path: Path, pods: Pods, node: str) -> None:
    """`usproxy run --cleanup` (agent stopped) deletes the tables; conntrack keeps the flows'
    entries, but a network namespace tracks connections only while a rule there uses conntrack,
    and applies an entry's NAT only while it has nat chains. When the usproxy tables were the
    only ones, neither holds any more: the next segment goes to the ClusterIP untranslated and
    is reset (or lost, once usproxy0 is gone too), a UDP session's next datagram is lost. With another nat table using conntrack (on
    a real node the CNI's masquerade, or iptables-nft's nat table) every flow runs on, on its
    endpoint. (A table with only a filter `ct` rule is not enough: tried, the flows time out.)"""
    cli = start_pods(topology, pods)
    m = Manifests(tmp_path / "m")
    agent = start_agent(topology, m, "fresh")
    if node == "other-nat-table":
        (tmp_path / "other.nft").write_text(OTHER_NAT)
        nsexec(topology.node, "nft", "-f", str(tmp_path / "other.nft"))
    try:
        k_tcp, k_udp = talk(cli, 4, 2)
        time.sleep(0.5)
        agent.stop()
        res = nsexec(topology.node, USPROXY, "run", "--cleanup", check=False)
        assert res.returncode == 0, res.stderr
        assert "usproxy" not in nsexec(topology.node, "nft", "list", "tables").stdout
        t_clean, before = time.monotonic(), counts(k_tcp)
        time.sleep(1.5)
        finish(k_tcp, k_udp)
        if node == "other-nat-table":
            kept(k_tcp, before, 4)
            one_endpoint(k_udp, t_clean, 10)
        else:
            # reset by the node while the ClusterIP is still local, lost once usproxy0 is gone
            assert all(t.errors and t.round_trips <= before[i] + 2 for i, t in enumerate(k_tcp)), \
                (before, [t.errors for t in k_tcp])
            assert all(not [a for a in s.answers if a[0] > t_clean + 0.5] for s in k_udp), [s.answers[-3:] for s in k_udp]
    finally:
        agent.stop()
        nsexec(topology.node, "nft", "delete", "table", "ip", "other", check=False)
