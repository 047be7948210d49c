"""Stale UDP conntrack entries (issue 29 items 7 and 8): the rule as a pure function of the UDP
Services (usproxy.core.stale_udp, kube-proxy's CleanStaleEntries with usproxy's safe-side
differences), and the child process that lists the kernel's table once and deletes in batches
(usproxy.offload.ctnetlink), on entries made in a throwaway namespace. The agent-level tests with
live sessions are tests/offload/test_udp_conntrack_reconcile.py."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.conntrack_fill import fill_udp
from tests.offload.helpers import ep, spn, state
from usproxy.offload import ctnetlink as c
from usproxy.offload.kernel_conntrack import KernelConntrack, _run_cleanup
from usproxy.core.stale_udp import StaleUdp, packed

DNS = spn("dns", "dns", "UDP")
WEB = spn("web", "http")


def hp(ip: str, port: int) -> tuple[bytes, int]:
    return packed(ip), port


def dns(*eps: str, node_port: int = 30053, **kw: object) -> object:
    return state(DNS, "10.96.0.10", 53, [ep(i, 53, **kw) for i in eps], node_port=node_port)


def test_a_frontends_entries_must_reply_from_a_serving_endpoint() -> None:
    rule = StaleUdp.of([dns("10.244.1.5", "10.244.1.6")])  # type: ignore[list-item]
    front = hp("10.96.0.10", 53)
    assert not rule.stale(front, hp("10.244.1.5", 53))
    assert rule.stale(front, hp("10.244.1.7", 53))  # an endpoint no longer there (removed while down)
    assert rule.stale(front, hp("10.244.1.5", 5353))  # its port changed: compared with the port
    assert not rule.stale(hp("10.96.0.99", 53), hp("10.244.1.7", 53))  # not a UDP frontend: not ours


def test_entries_that_were_not_dnated_are_never_stale() -> None:
    """The relay's own flows (and flows captured to the relay's port on the same address) reply
    from the frontend address itself: a reconcile must not move a session the relay drains."""
    rule = StaleUdp.of([dns("10.244.1.5")])  # type: ignore[list-item]
    assert not rule.stale(hp("10.96.0.10", 53), hp("10.96.0.10", 53))
    assert not rule.stale(hp("10.96.0.10", 53), hp("10.96.0.10", 41234))
    assert not rule.stale(hp("192.0.2.10", 30053), hp("192.0.2.10", 30053))


def test_serving_counts_not_ready_or_policy() -> None:
    """kube-proxy: IsServing, whatever readiness and traffic policies say (a policy change moves
    no live flow); an endpoint that stopped serving is stale."""
    rule = StaleUdp.of([dns("10.244.1.5", ready=False, serving=True)])  # type: ignore[list-item]
    assert not rule.stale(hp("10.96.0.10", 53), hp("10.244.1.5", 53))
    rule = StaleUdp.of([dns("10.244.1.5", ready=False, serving=False)])  # type: ignore[list-item]
    assert rule.stale(hp("10.96.0.10", 53), hp("10.244.1.5", 53))


def test_nodeports_judge_any_address_that_is_no_frontend() -> None:
    rule = StaleUdp.of([dns("10.244.1.5"),  # type: ignore[list-item]
                        state(spn("other", "x", "UDP"), "10.96.0.20", 30053, [ep("10.244.3.3", 30053)])])
    assert rule.stale(hp("192.0.2.10", 30053), hp("10.244.1.7", 53))
    assert not rule.stale(hp("192.0.2.10", 30053), hp("10.244.1.5", 53))
    # a ClusterIP whose port equals the NodePort keeps its own rule
    assert not rule.stale(hp("10.96.0.20", 30053), hp("10.244.3.3", 30053))


def test_a_removed_services_frontends_count_with_no_endpoint() -> None:
    gone = dns("10.244.1.5")
    rule = StaleUdp.of([], [gone])  # type: ignore[list-item]
    assert rule.stale(hp("10.96.0.10", 53), hp("10.244.1.5", 53))
    again = StaleUdp.of([dns("10.244.1.5")], [gone])  # type: ignore[list-item]
    assert not again.stale(hp("10.96.0.10", 53), hp("10.244.1.5", 53))  # the frontend is used again


def test_tcp_services_are_not_judged_and_the_rule_survives_json() -> None:
    tcp = state(WEB, "10.96.0.30", 80, [ep("10.244.1.5")])
    rule = StaleUdp.of([tcp, dns("10.244.1.5")])  # type: ignore[list-item]
    assert hp("10.96.0.30", 80) not in rule.frontends
    gone = StaleUdp.replying_from([("10.244.9.9", 53)])
    for r in (rule, gone, StaleUdp.of([state(DNS, "fd00::10", 53, [ep("fd00::5", 53)])])):
        assert StaleUdp.from_json(r.to_json()) == r
    assert gone.stale(hp("10.96.0.77", 53), hp("10.244.9.9", 53))
    assert rule.families() == (socket.AF_INET, socket.AF_INET6)  # a NodePort: either family
    assert StaleUdp.of([tcp]).families() == () and not StaleUdp.of([tcp])


@pytest.mark.netns
def test_the_cleanup_child_deletes_exactly_the_stale_entries(topology: Topology) -> None:
    with inside(topology.node):
        assert fill_udp(3000, ("10.96.0.10", 53), ("10.244.1.5", 53)) == 3000
        assert fill_udp(2000, ("10.96.0.10", 53), ("10.244.1.6", 53), clients="10.244.201.0") == 2000
        assert fill_udp(1000, ("10.96.0.10", 53), ("10.96.0.10", 53), clients="10.244.202.0") == 1000  # the relay's
        assert fill_udp(500, ("10.96.0.11", 53), ("10.244.1.9", 53)) == 500  # no UDP Service: not ours
    nsexec(topology.node, "sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1")
    ct = KernelConntrack(topology.node)
    try:
        summary = asyncio.run(ct.reconcile_udp(StaleUdp.of([dns("10.244.1.6")])))  # type: ignore[list-item]
    finally:
        ct.close()
    # one dump the kernel filters per frontend and NodePort: the other frontend's 500 are not even read
    assert summary["listed"] == 6000 and summary["stale"] == summary["deleted"] == 3000, summary
    left = nsexec(topology.node, "conntrack", "-L", "-p", "udp").stdout
    assert "src=10.244.1.5" not in left and left.count("src=10.244.1.6") == 2000
    assert left.count("] src=10.96.0.10 ") == 1000 and left.count("src=10.244.1.9") == 500


@pytest.mark.netns
def test_every_turned_answer_entry_is_deleted(topology: Topology) -> None:
    """KernelConntrack.delete_udp_turned_answers (the IPVS datapath's offload of a relayed UDP
    Service): entries whose original source is an endpoint and whose reply goes to the Service
    address, one per relayed session, all go; others stay. It once deleted the first and failed
    ("Event loop is closed"), leaving a second session without answers."""
    ep, vip = socket.inet_aton("10.244.1.5"), socket.inet_aton("10.96.10.20")
    msgs = []
    for i, (src, peer) in enumerate([(ep, vip), (ep, vip), (ep, vip), (ep, socket.inet_aton("10.96.10.21"))]):
        client, port = socket.inet_aton(f"10.244.9.{10 + i}"), 40000 + i
        orig = c.tuple_attr(c.CTA_TUPLE_ORIG, socket.AF_INET, src, client, 8080, port, socket.IPPROTO_UDP)
        reply = c.tuple_attr(c.CTA_TUPLE_REPLY, socket.AF_INET, client, peer, port, 50000 + i, socket.IPPROTO_UDP)
        body = orig + reply + c.attr(c.CTA_TIMEOUT, struct.pack("!I", 600))
        msgs.append(c.message(c.IPCTNL_MSG_CT_NEW, c.NLM_F_REQUEST | c.NLM_F_CREATE, socket.AF_INET, body))
    with inside(topology.node):
        conn = c.Conntrack()
        try:
            assert conn.send_batched(msgs) == 4
        finally:
            conn.close()
    ct = KernelConntrack(topology.node)
    try:
        assert asyncio.run(ct.delete_udp_turned_answers([(("10.244.1.5", 8080), "10.96.10.20")])) == 3
    finally:
        ct.close()
    left = nsexec(topology.node, "conntrack", "-L", "-p", "udp").stdout
    assert "dst=10.96.10.20" not in left and left.count("dst=10.96.10.21") == 1, left


@pytest.mark.netns
def test_entries_listed_before_a_change_are_deleted_after_it_without_a_new_listing(topology: Topology) -> None:
    """KernelConntrack.list_udp then delete_listed (the IPVS datapath lists a relayed UDP
    frontend's entries before its virtual server goes in, and deletes them right after): exactly
    the entries to that frontend when listed go, of every session, the relay's own included;
    entries made after the listing stay (the datapath's next delete_udp takes them); another
    frontend's are never read."""
    with inside(topology.node):
        assert fill_udp(3, ("10.96.0.10", 53), ("10.96.0.10", 53)) == 3  # relayed sessions: no NAT
        assert fill_udp(2, ("10.96.0.10", 53), ("10.244.1.5", 53), clients="10.244.201.0") == 2
        assert fill_udp(4, ("10.96.0.11", 53), ("10.96.0.11", 53), clients="10.244.202.0") == 4

    async def change() -> tuple[int, int]:
        ct = KernelConntrack(topology.node)
        try:
            listed = await ct.list_udp([("10.96.0.10", 53)])
            with inside(topology.node):  # a session that starts between the listing and the delete
                assert fill_udp(1, ("10.96.0.10", 53), ("10.96.0.10", 53), clients="10.244.203.0") == 1
            return len(listed), await ct.delete_listed(listed)
        finally:
            ct.close()

    assert asyncio.run(change()) == (5, 5)
    left = nsexec(topology.node, "conntrack", "-L", "-p", "udp").stdout
    assert left.count("dst=10.96.0.10 ") == 1 and "src=10.244.203.1 " in left, left
    assert left.count("dst=10.96.0.11 ") == 4, left


def test_a_failing_child_is_an_error_naming_it() -> None:
    with pytest.raises(OSError, match="conntrack cleanup: not a StaleUdp rule: Expecting property name"):
        _run_cleanup("{not json")
