"""IpvsDatapath without a kernel (FakeIpvsKernel, FakeIpvsTools): what it installs is the
generator's that explain prints; syncs change only what differs; a real server with connections
is terminated gracefully; an unwanted virtual server with connections is retired (new connections
to the local socket) and revived when wanted again; a restart adopts the virtual servers usproxy's
set names and nothing else; a refused step is repaired by the next pass; cleanup removes only what
is usproxy's. (The same against the kernel: tests/offload/ipvs/test_kernel.py, in the VM lab.)"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Iterable, Sequence

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.model.types import IPAddress, ServicePortName
from usproxy.offload.iptables.saved import parse
from usproxy.offload.ipvs import rules
from usproxy.offload.ipvs.fake import FakeIpvsKernel, FakeIpvsTools
from usproxy.offload.ipvs.datapath import PROBE_VS
from usproxy.offload.ipvs.kernel import Dest, Service
from usproxy.util.errors import OffloadError

from tests.offload.helpers import ep, every_feature, spn, state
from tests.offload.ipvs.helpers import NoConntrack, datapath
from usproxy.offload.kernel_conntrack import ListedUdp

WEB, DNS = spn("web", "http"), spn("dns", "dns", "UDP")
IP = ipaddress.ip_address


def web(eps: Sequence[str] = ("10.244.1.1", "10.244.2.1"), **kw: object) -> ServicePortState:
    return state(WEB, "10.96.0.1", 80, [ep(a) for a in eps], **kw)


def vs_key(proto: str, addr: str, port: int) -> tuple[str, IPAddress, int]:
    return (proto, IP(addr), port)


def reals(k: FakeIpvsKernel, key: tuple[str, IPAddress, int]) -> dict[str, int]:
    return {f"{d.address}:{d.port}": d.weight for d in k.reals[key].values()}


@pytest.fixture
def kernel() -> FakeIpvsKernel:
    return FakeIpvsKernel()


async def test_installs_the_generators_state_that_explain_prints(kernel: FakeIpvsKernel) -> None:
    tools = FakeIpvsTools()
    dp = datapath(kernel, tools)
    states = every_feature()
    await dp.apply(states)
    for family in (4, 6):
        t = dp.tables(family)
        servers = t.servers()
        assert {k for k in kernel.services if k[1].version == family} == set(servers)
        for key, vs in servers.items():
            svc = kernel.services[key]
            assert (svc.scheduler, svc.timeout, bool(svc.flags & rules.PERSISTENT)) == \
                (vs.scheduler, vs.persistent or 0, bool(vs.persistent))
            assert reals(kernel, key) == {f"{e.ip}:{e.port}" if e.ip.version == 4 else f"{e.ip}:{e.port}": 1
                                          for e in vs.reals}
        for s in rules.SETS:
            assert kernel.members(s.named(family)) == set(t.entries[s.name]), s.name
        assert {a for a in kernel.addresses or () if a.version == family} == set(t.bound)
        saved = parse(tools.save("nft", family))
        for table, text in zip(("nat", "filter"), t.restore_input(random_fully=True).split("*filter")):
            for chain in {r.chain for r in saved[table].rules if r.chain.startswith("KUBE-")}:
                assert [r.text() for r in saved[table].in_chain(chain)] == \
                    [line for line in text.splitlines() if line.startswith(f"-A {chain} ")], (table, chain)
        jumps = {r.text() for table in saved.values() for r in table.rules if not r.chain.startswith("KUBE-")}
        assert jumps == {j.text() for j in rules.JUMPS}
    # every virtual server is named in usproxy's set, with its ServicePortName
    named = kernel.members("USPROXY-IPVS") | kernel.members("USPROXY-6-IPVS")
    assert len(named) == len(kernel.services)
    assert 'comment "default/web:http/TCP"' in "".join(named)


async def test_the_scheduler_and_persistence_follow_the_service_port(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    lc = spn("lc")
    await dp.apply({WEB: web(session_affinity="ClientIP", affinity_timeout=30),
                    lc: state(lc, "10.96.0.2", 80, [ep("10.244.1.1")], lb_policy="leastConnections")})
    assert kernel.services[vs_key("TCP", "10.96.0.1", 80)] == Service("TCP", IP("10.96.0.1"), 80, "rr", 1, 30)
    assert kernel.services[vs_key("TCP", "10.96.0.2", 80)] == Service("TCP", IP("10.96.0.2"), 80, "lc", 0, 0)


async def test_an_endpoint_change_touches_only_that_real_server(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    await dp.apply({WEB: web(node_port=30080, service_type="NodePort"), DNS: state(DNS, "10.96.0.10", 53,
                                                                                   [ep("10.244.1.1", 53)])})
    kernel.calls.clear()
    await dp.apply({WEB: web(("10.244.1.1", "10.244.2.1", "10.244.3.1"), node_port=30080, service_type="NodePort")})
    assert sorted(kernel.calls) == ["add_dest", "add_dest"]  # the ClusterIP and the NodePort virtual server
    assert reals(kernel, vs_key("TCP", "192.0.2.10", 30080)) == {
        "10.244.1.1:8080": 1, "10.244.2.1:8080": 1, "10.244.3.1:8080": 1}


async def test_a_tcp_real_server_with_connections_is_terminated_gracefully(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    key = vs_key("TCP", "10.96.0.1", 80)
    await dp.apply({WEB: web()})
    kernel.conns[(key, (IP("10.244.2.1"), 8080))] = 3
    await dp.apply({WEB: web(("10.244.1.1",))})
    assert reals(kernel, key) == {"10.244.1.1:8080": 1, "10.244.2.1:8080": 0}  # weight 0: no new connection
    assert dp.collect() is True  # still busy
    kernel.conns.clear()
    assert dp.collect() is False
    assert reals(kernel, key) == {"10.244.1.1:8080": 1}


async def test_a_udp_real_server_goes_at_once(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    key = vs_key("UDP", "10.96.0.10", 53)
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53), ep("10.244.2.1", 53)])})
    kernel.conns[(key, (IP("10.244.2.1"), 53))] = 5
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert reals(kernel, key) == {"10.244.1.1:53": 1}


async def test_an_unwanted_virtual_server_with_connections_is_retired_then_revived(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    key = vs_key("TCP", "10.96.0.1", 80)
    await dp.apply({WEB: web()})
    kernel.conns[(key, (IP("10.244.1.1"), 8080))] = 1
    await dp.apply({WEB: None})  # demoted to the relay
    # its busy real server stays at weight 0, the idle one went, new connections to the VIP itself
    assert reals(kernel, key) == {"10.244.1.1:8080": 0, "10.96.0.1:80": 1}
    assert kernel.members("KUBE-CLUSTER-IP") == set() and IP("10.96.0.1") not in (kernel.addresses or ())
    assert any(m.startswith("10.96.0.1,tcp:80 ") for m in kernel.members("USPROXY-IPVS"))  # still ours
    kernel.conns[(key, (IP("10.96.0.1"), 80))] = 1  # a relay connection made through it
    await dp.apply({WEB: web()})  # wanted again before it went idle
    # the local real server waits at weight 0 for its connection, the endpoints serve again
    assert reals(kernel, key) == {"10.244.1.1:8080": 1, "10.244.2.1:8080": 1, "10.96.0.1:80": 0}
    kernel.conns.clear()
    dp.collect()
    assert reals(kernel, key) == {"10.244.1.1:8080": 1, "10.244.2.1:8080": 1}


async def test_an_idle_unwanted_virtual_server_is_deleted_with_its_name(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    await dp.apply({WEB: web()})
    await dp.apply({WEB: None})
    assert kernel.services == {} and kernel.members("USPROXY-IPVS") == set()


async def test_a_retired_virtual_server_goes_once_idle(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    key = vs_key("TCP", "10.96.0.1", 80)
    await dp.apply({WEB: web()})
    kernel.conns[(key, (IP("10.244.1.1"), 8080))] = 1
    await dp.apply({WEB: None})
    kernel.conns[(key, (IP("10.96.0.1"), 80))] = 4  # relay connections through it do not keep it
    assert dp.collect() is True
    kernel.conns.pop((key, (IP("10.244.1.1"), 8080)))
    assert dp.collect() is False
    assert key not in kernel.services and kernel.members("USPROXY-IPVS") == set()


async def test_a_restart_adopts_what_usproxys_set_names_and_nothing_else(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    await dp.apply({WEB: web(), DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    theirs = Service("TCP", IP("198.51.100.7"), 443, "wlc")
    kernel.add_service(theirs)
    kernel.add_dest(theirs.key, Dest(IP("198.51.100.8"), 443))
    before = dict(kernel.services)
    dp.close()
    dp2 = datapath(kernel)
    assert await dp2.read_back() == {WEB: (ep("10.244.1.1"), ep("10.244.2.1")), DNS: (ep("10.244.1.1", 53),)}
    kernel.calls.clear()
    await dp2.apply({WEB: web(), DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert [c for c in kernel.calls if c != "dump"] == []  # adopted as it was: nothing rewritten
    assert kernel.services == before
    await dp2.apply({WEB: None, DNS: None})
    assert kernel.services == {theirs.key: theirs}  # another program's virtual server stays


async def test_a_refused_step_raises_and_the_next_pass_repairs(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    await dp.apply({WEB: web()})
    kernel.schedulers.discard("lc")
    lc = spn("lc")
    with pytest.raises(OffloadError):
        await dp.apply({lc: state(lc, "10.96.0.2", 80, [ep("10.244.1.1")], lb_policy="leastConnections")})
    assert vs_key("TCP", "10.96.0.2", 80) not in kernel.services
    kernel.fail_on = "add_dest"
    with pytest.raises(OffloadError):
        await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert reals(kernel, vs_key("UDP", "10.96.0.10", 53)) == {"10.244.1.1:53": 1}
    assert kernel.members("KUBE-CLUSTER-IP") == {"10.96.0.1,tcp:80", "10.96.0.10,udp:53"}


async def test_cleanup_removes_only_usproxys(kernel: FakeIpvsKernel) -> None:
    tools = FakeIpvsTools()
    dp = datapath(kernel, tools)
    await dp.apply(every_feature())
    theirs = Service("UDP", IP("198.51.100.7"), 53, "rr")
    kernel.add_service(theirs)
    tools.restore("nft", 4, "*nat\n:DOCKER - [0:0]\n-A POSTROUTING -s 172.17.0.0/16 -j MASQUERADE\nCOMMIT\n")
    assert "device kube-ipvs0" in await dp.leftovers()
    await dp.cleanup()
    assert kernel.services == {theirs.key: theirs}
    assert kernel.addresses is None and kernel.sets == {}
    nat = parse(tools.save("nft", 4))["nat"]
    assert [r.text() for r in nat.rules] == ["-A POSTROUTING -s 172.17.0.0/16 -j MASQUERADE"]
    assert await dp.leftovers() == []


async def test_leftovers_at_an_agents_start_keep_busy_virtual_servers(kernel: FakeIpvsKernel) -> None:
    """At an agent's start with another --offload (keep_busy) a virtual server carrying
    connections stays, named in USPROXY-IPVS, and the leftovers listed (and logged as removed)
    leave it out; an idle one goes; --cleanup (no keep_busy) removes it too."""
    tools = FakeIpvsTools()
    dp = datapath(kernel, tools)
    await dp.apply({WEB: web(), DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    busy = vs_key("TCP", "10.96.0.1", 80)
    kernel.conns[(busy, (IP("10.244.1.1"), 8080))] = 3
    listed = await dp.leftovers(keep_busy=True)
    assert "1 IPVS virtual servers" in listed, listed
    await dp.cleanup(keep_busy=True)
    assert list(kernel.services) == [busy]
    assert kernel.members("USPROXY-IPVS") == {'10.96.0.1,tcp:80 comment "default/web:http/TCP"'}
    assert await dp.leftovers(keep_busy=True) == []  # nothing more to remove while it is busy
    await dp.cleanup()
    assert kernel.services == {} and kernel.sets == {}


async def test_udp_entries_to_a_frontend_new_here_go_once(kernel: FakeIpvsKernel) -> None:
    """A UDP ServicePort new to this datapath (a new Service, or one the relay served) has its
    frontend's conntrack entries deleted once, with those an endpoint's answer turned into the
    Service address's made (a relayed session's entry would clash with IPVS's answers: test_kernel,
    in the VM lab); an endpoint change does not; after a restart, the ServicePorts read back are
    not new."""
    dp = datapath(kernel)
    ct: NoConntrack = dp.conntrack  # type: ignore[assignment]
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert ct.listed == ct.deleted == [{("10.96.0.10", 53)}]
    assert ct.turned == [{(("10.244.1.1", 53), "10.96.0.10")}]
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53), ep("10.244.2.1", 53)])})
    assert len(ct.deleted) == 1 and len(ct.turned) == 1
    dp2 = datapath(kernel)
    await dp2.read_back()
    await dp2.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53), ep("10.244.2.1", 53)])})
    assert dp2.conntrack.deleted == [] and dp2.conntrack.turned == []  # type: ignore[attr-defined]


async def test_a_relayed_udp_sessions_entries_are_listed_before_the_virtual_server_and_deleted_right_after(
        kernel: FakeIpvsKernel) -> None:
    """The window in which IPVS's answers to a relayed session clash with its entry runs from the
    virtual server's write to the entry's delete: the entries are listed before the write (no
    socket opened, no table dumped inside the window), deleted next, then swept once more for
    entries made meanwhile, all before the iptables rules are written."""
    tools = FakeIpvsTools()
    seen: list[tuple[str, bool, int]] = []
    dns_key = vs_key("UDP", "10.96.0.10", 53)

    class Watching(NoConntrack):
        def note(self) -> None:
            seen.append((self.calls[-1], dns_key in kernel.services, len(tools.restores)))

        async def list_udp(self, orig_dst: Iterable[tuple[str, int]]) -> ListedUdp:
            out = await super().list_udp(orig_dst)
            self.note()
            return out

        async def delete_listed(self, listed: ListedUdp) -> int:
            n = await super().delete_listed(listed)
            self.note()
            return n

        async def delete_udp(self, *, reply_src: object = (), orig_dst: object = ()) -> int:
            n = await super().delete_udp(reply_src=reply_src, orig_dst=orig_dst)
            self.note()
            return n

    dp = datapath(kernel, tools)
    dp.conntrack = Watching()
    await dp.apply({})  # the datapath's own set-up (tables, probes) first
    before = len(tools.restores)
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert [(name, vs_in) for name, vs_in, _ in seen] == [
        ("list_udp", False), ("delete_listed", True), ("delete_udp", True)]
    assert all(n == before for _, _, n in seen), (seen, tools.restores[before:])  # no iptables yet
    assert len(tools.restores) > before  # and then the rules


class WatchedKernel(FakeIpvsKernel):
    """Notes, at every call, each virtual server that exists with no real server: what a packet
    arriving then would find (IPVS: "no destination available", an ICMP port unreachable)."""

    def __init__(self) -> None:
        super().__init__()
        self.empty: set[tuple[str, IPAddress, int]] = set()

    def _enter(self, what: str) -> None:
        self.empty |= {k for k in self.services if not self.reals.get(k) and k != PROBE_VS}
        super()._enter(what)


async def test_a_new_virtual_server_never_exists_without_a_real_server() -> None:
    """Its first real server goes in the same netlink write (kernel.py); the VM lab's relayed UDP
    session saw ECONNREFUSED when it went in a second one."""
    kernel = WatchedKernel()
    dp = datapath(kernel)
    await dp.apply({WEB: web(), DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53), ep("10.244.2.1", 53)])})
    await dp.apply({WEB: web(("10.244.3.1",))})
    assert kernel.services and kernel.empty == set()
    assert reals(kernel, vs_key("UDP", "10.96.0.10", 53)) == {"10.244.1.1:53": 1, "10.244.2.1:53": 1}
    assert reals(kernel, vs_key("TCP", "10.96.0.1", 80)) == {"10.244.3.1:8080": 1}


async def test_reading_back_creates_nothing(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    assert await dp.read_back() == {}
    assert kernel.addresses is None and kernel.sets == {}


def test_the_probe(kernel: FakeIpvsKernel) -> None:
    assert datapath(kernel).probe().available
    cap = datapath(FakeIpvsKernel(loaded=False), load_module=False).probe()
    assert not cap.available and "ip_vs is not loaded" in cap.detail
    cap = datapath(FakeIpvsKernel(ipset_tool=False)).probe()
    assert not cap.available and "ipset" in cap.detail
    cap = datapath(kernel, FakeIpvsTools(socket_match=False)).probe()
    assert not cap.available and "refused" in cap.detail


def test_what_it_does_not_serve(kernel: FakeIpvsKernel) -> None:
    dp = datapath(kernel)
    sctp = spn("s", proto="SCTP")
    assert dp.unsupported(state(sctp, "10.96.0.3", 80, [])) == "SCTP is served by the relay only"
    assert dp.unsupported(web()) is None


def test_spn_text_round_trips() -> None:
    assert ServicePortName.from_key(WEB.key()) == WEB


def kernel_state(k: FakeIpvsKernel) -> tuple[object, ...]:
    return (k.services, {key: set(r.values()) for key, r in k.reals.items()},
            {name: members for name, (_, _, members) in k.sets.items()}, k.addresses)


async def test_partial_syncs_end_where_a_cold_sync_of_the_same_state_does() -> None:
    """A partial sync compares only what the changed ServicePorts touch (datapath._Scope). Over
    random changes (endpoints, affinity, NodePorts, removals, and an externalIP:port that several
    Services claim, whose virtual server passes to the next claimant by name), after every one the
    kernel holds what a cold sync of the same ServicePorts into an empty kernel holds."""
    rng = random.Random(25)
    kernel = FakeIpvsKernel()
    dp = datapath(kernel)
    current: dict[ServicePortName, ServicePortState] = {}
    for _ in range(80):
        changes: dict[ServicePortName, ServicePortState | None] = {}
        for _ in range(rng.randint(1, 3)):
            n = rng.randrange(8)
            name = spn(f"s{n}", "http", "UDP" if n == 7 else "TCP")
            if rng.random() < 0.2:
                changes[name] = None
                continue
            eps = [ep(f"10.244.{rng.randrange(3)}.{rng.randrange(1, 4)}") for _ in range(rng.randint(0, 3))]
            kw: dict[str, object] = {"external_ips": ["198.51.100.9"] if rng.random() < 0.5 else []}
            if rng.random() < 0.3:
                kw.update(session_affinity="ClientIP", affinity_timeout=rng.choice((30, 60)))
            if rng.random() < 0.3:
                kw.update(node_port=30000 + n, service_type="NodePort")
            changes[name] = state(name, f"10.96.0.{n + 1}", 80, eps, **kw)
        await dp.apply(changes)
        for name, st in changes.items():
            if st is None:
                current.pop(name, None)
            else:
                current[name] = st
        cold = FakeIpvsKernel()
        await datapath(cold).apply(dict(current))
        assert kernel_state(kernel) == kernel_state(cold)
