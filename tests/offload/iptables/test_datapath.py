"""IptablesDatapath without a kernel (FakeIptablesClient): the rules it writes are the generator's
that explain prints, partial syncs send only the changed chains, full syncs repair and delete
stale chains, a refused sync changes nothing, a restart adopts what the kernel holds, cleanup
leaves every other program's rules, and what the datapath refuses to serve."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.model.node import NodeFacts
from usproxy.model.service_set import Node, ServiceSet
from usproxy.model.types import ServicePortName
from usproxy.model import chain_names
from usproxy.model.types import Family
from usproxy.offload.iptables import rules
from usproxy.offload.iptables.datapath import IptablesDatapath
from usproxy.offload.iptables.fake import FakeIptablesClient
from usproxy.offload.iptables.saved import parse
from usproxy.offload.kernel_conntrack import KernelConntrack
from usproxy.util.errors import OffloadError

from tests.offload.helpers import ep, every_feature, spn, state

WEB, DNS = spn("web", "http"), spn("dns", "dns", "UDP")


class NoConntrack(KernelConntrack):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[set[tuple[str, int]]] = []

    async def delete_udp(self, *, reply_src: object = (), orig_dst: object = ()) -> int:
        self.deleted.append(set(orig_dst))  # type: ignore[call-overload]
        return 0

    def enable_accounting(self) -> bool:
        return True


@pytest.fixture
def fake() -> FakeIptablesClient:
    return FakeIptablesClient()


def datapath(fake: FakeIptablesClient, **kw: object) -> IptablesDatapath:
    return IptablesDatapath(fake, NoConntrack(), node=NodeFacts("node"), **kw)  # type: ignore[arg-type]


def served(dp: IptablesDatapath) -> dict[ServicePortName, ServicePortState]:
    """every_feature() but what this datapath leaves to the relay (lb-policy roundRobin)."""
    return {k: v for k, v in every_feature().items() if dp.unsupported(v) is None}


def kube_chains(fake: FakeIptablesClient, family: int = 4, backend: str = "nft") -> dict[str, dict[str, list[str]]]:
    return {t: {c: list(rs) for c, rs in table.chains.items() if c.startswith("KUBE-")}
            for t, table in fake.family_tables(backend, family).items()}


def explained(states: dict[ServicePortName, ServicePortState], family: Family = 4) -> str:
    """What `usproxy explain --mode iptables` renders for the same ServicePorts (its generator,
    its FamilyPorts built from the manifests' endpoints, explain's default options), with the
    datapath's one addition to kube-proxy's rules (Options.service_address_source)."""
    ss = ServiceSet(tuple((st.service_port, st.endpoints) for _, st in sorted(states.items())), Node("node"))
    return rules.render_ruleset(rules.build(ss, family, rules.Options(service_address_source=True)))


async def test_the_rules_written_are_the_ones_explain_prints(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    states = served(dp)
    await dp.apply(states)
    for family in (4, 6):
        rs = dp.ruleset(family)
        assert rs is not None and rules.render_ruleset(rs) == explained(states, family)
        # and the fake kernel holds exactly those chains with those rules
        held = kube_chains(fake, family)
        for table in ("filter", "nat"):
            for chain, rs_rules in rules.ordered(rs, table):
                assert held[table][chain] == [" ".join(r.tokens) for r in rs_rules]


async def test_the_first_read_back_installs_skeleton_jumps_and_canaries(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    assert await dp.read_back() == {}
    tables = fake.family_tables("nft", 4)
    assert tables["nat"].chains["PREROUTING"] == ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES']
    assert "KUBE-PROXY-CANARY" in tables["mangle"].chains and "KUBE-PROXY-CANARY" in tables["filter"].chains
    # FIREWALL, PROXY-FIREWALL, NODEPORTS, EXTERNAL-SERVICES, and usproxy's KUBE-SERVICES (local ClusterIPs)
    assert len(tables["filter"].chains["INPUT"]) == 5


async def test_a_partial_sync_sends_only_the_changed_chains_and_deletes_stale_ones(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    web = state(WEB, "10.96.0.1", 80, [ep("10.244.1.1"), ep("10.244.2.1")])
    dns = state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])
    await dp.apply({WEB: web, DNS: dns})
    before, restores = kube_chains(fake)["nat"], len(fake.restores)
    await dp.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    text = dp.last_input[4]
    assert dp.full_syncs == 1 and dp.syncs == 2
    assert f":{chain_names.svc_chain(WEB)} - [0:0]" in text
    assert f":{chain_names.svc_chain(DNS)} " not in text  # DNS's chains are not sent, only its KUBE-SERVICES rule
    gone = chain_names.sep_chain(WEB, ep("10.244.2.1"))
    assert f"-X {gone}" in text and gone not in kube_chains(fake)["nat"]
    after = kube_chains(fake)["nat"]
    assert after[chain_names.svc_chain(DNS)] == before[chain_names.svc_chain(DNS)]
    assert [tool for tool, _ in fake.restores[restores:]] == ["iptables-nft-restore"]  # no IPv6 change


async def test_a_refused_partial_sync_is_retried_as_a_full_one(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    await dp.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    fake.fail_next = 1
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert dp.full_syncs == 2 and set(dp.installed) == {WEB, DNS}


async def test_a_refused_full_sync_changes_nothing_and_the_next_one_is_full(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    await dp.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    held = kube_chains(fake)
    fake.fail_next = 2  # the partial sync and its full retry
    with pytest.raises(OffloadError):
        await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert set(dp.installed) == {WEB} and kube_chains(fake) == held
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert dp.full_syncs == 2 and set(dp.installed) == {WEB, DNS}


async def test_a_restart_adopts_the_rules_and_deletes_only_what_is_no_longer_wanted(fake: FakeIptablesClient) -> None:
    first = datapath(fake)
    states = served(first)
    await first.apply(states)
    held = kube_chains(fake)
    second = datapath(fake)
    found = await second.read_back()
    assert set(found) == set(states)
    for spn_, st in states.items():  # endpoints read from the KUBE-SEP DNAT targets
        reachable = {str(e) for e in (*st.cluster_endpoints, *st.external_endpoints, *st.short_circuit_endpoints)}
        assert {str(e) for e in found[spn_]} == reachable, spn_
    await second.apply(states)  # the agent adopts: the same rules, written in one full sync
    assert kube_chains(fake) == held and second.full_syncs == 1
    await second.apply({WEB: None})
    nat = kube_chains(fake)["nat"]
    assert not any(c in nat for c in (chain_names.svc_chain(WEB), chain_names.ext_chain(WEB)))


async def test_a_full_sync_deletes_stale_chains_left_by_an_earlier_run(fake: FakeIptablesClient) -> None:
    first = datapath(fake)
    await first.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")]),
                       DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    second = datapath(fake)
    await second.read_back()
    await second.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})  # DNS is not wanted any more
    nat = kube_chains(fake)["nat"]
    assert chain_names.svc_chain(DNS) not in nat and chain_names.svc_chain(WEB) in nat


async def test_crossing_into_large_cluster_mode_rewrites_every_chain(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    many = {spn(f"s{i}"): state(spn(f"s{i}"), f"10.96.{i // 200}.{i % 200 + 1}", 80,
                                [ep(f"10.244.{i // 100}.{i % 100 + 1}"), ep(f"10.245.{i // 100}.{i % 100 + 1}")])
            for i in range(500)}
    await dp.apply(many)
    assert "-m comment --comment default/s0 -s" in dp.last_input[4]
    big = state(WEB, "10.96.9.1", 80, [ep(f"10.246.0.{i}") for i in range(1, 3)])
    await dp.apply({WEB: big})  # 1,002 endpoints: large-cluster mode, SEP comments go everywhere
    rs = dp.ruleset(4)
    assert rs is not None and rules.render_ruleset(rs) == explained({**many, WEB: big})
    assert "--comment default/s0 -s" not in dp.last_input[4] and ":KUBE-SEP-" in dp.last_input[4]
    assert kube_chains(fake)["nat"][chain_names.sep_chain(spn("s0"), ep("10.244.0.1"))][0].startswith("-s 10.244.0.1")


async def test_cleanup_leaves_other_programs_rules(fake: FakeIptablesClient) -> None:
    foreign = ("*filter\n:DOCKER-USER - [0:0]\n-A FORWARD -j DOCKER-USER\n-A DOCKER-USER -j RETURN\n"
               "-A INPUT -p tcp --dport 22 -j ACCEPT\nCOMMIT\n"
               "*nat\n:DOCKER - [0:0]\n-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER\n"
               "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE\nCOMMIT\n")
    for backend in ("nft", "legacy"):
        fake.restore(backend, 4, foreign)
    saved = {b: fake.save(b, 4) for b in ("nft", "legacy")}
    dp = datapath(fake)
    await dp.read_back()
    await dp.apply(served(dp))
    fake.restore("legacy", 4, "*nat\n:KUBE-SVC-LEFTOVERFROMOLD1 - [0:0]\nCOMMIT\n")  # an older run with legacy
    await dp.cleanup()
    for b in ("nft", "legacy"):
        left = parse(fake.save(b, 4))
        assert {t: {c: [r.spec for r in tb.in_chain(c)] for c in tb.chains} for t, tb in left.items()
                if t in ("filter", "nat")} == {t: {c: [r.spec for r in tb.in_chain(c)] for c in tb.chains}
                                                for t, tb in parse(saved[b]).items()}, b
    assert "KUBE-" not in fake.save("nft", 6)


async def test_cleanup_keeps_a_chain_another_program_jumps_to_and_kubelets_firewall(fake: FakeIptablesClient) -> None:
    dp = datapath(fake)
    await dp.read_back()
    await dp.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    fake.restore("nft", 4, "*nat\n:CNI-HOSTPORT - [0:0]\n-A CNI-HOSTPORT -j KUBE-MARK-MASQ\nCOMMIT\n"
                           "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n")
    await dp.cleanup()
    left = kube_chains(fake)
    assert set(left["nat"]) == {"KUBE-MARK-MASQ"} and set(left["filter"]) == {"KUBE-FIREWALL"}
    assert "-j KUBE-FIREWALL" in fake.family_tables("nft", 4)["filter"].chains["INPUT"]
    assert set(left["mangle"]) == {"KUBE-IPTABLES-HINT"}


async def test_udp_frontends_that_get_their_first_endpoints_lose_their_conntrack_entries(fake: FakeIptablesClient) -> None:
    ct = NoConntrack()
    dp = IptablesDatapath(fake, ct, node=NodeFacts("node"))
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [])})
    await dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.1", 53)])})
    assert ct.deleted == [{("10.96.0.10", 53)}]


def test_what_the_datapath_leaves_to_others(fake: FakeIptablesClient) -> None:
    dp = IptablesDatapath(FakeIptablesClient(v6=False), NoConntrack(), node=NodeFacts("node"))
    assert dp.probe().available and dp.families == (4,) and "IPv6 not served" in dp.probe().detail
    base = state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])
    sp = base.service_port
    assert dp.unsupported(base) is None
    assert dp.unsupported(replace(base, service_port=replace(sp, name=sp.name._replace(protocol="SCTP")))) is not None
    assert "random" in str(dp.unsupported(replace(base, service_port=replace(sp, lb_policy="roundRobin"))))
    assert dp.unsupported(replace(base, service_port=replace(sp, lb_policy="random"))) is None
    six = replace(sp, cluster_ips=(ipaddress.ip_address("2001:db8::1"),))
    assert dp.unsupported(replace(base, service_port=six)) is not None


def test_a_kernel_without_nf_tables_gets_legacy() -> None:
    dp = IptablesDatapath(FakeIptablesClient(backends=("legacy",)), NoConntrack())
    cap = dp.probe()
    assert cap.available and dp.tools is not None and dp.tools.backend == "legacy", cap
    assert not IptablesDatapath(FakeIptablesClient(backends=()), NoConntrack()).probe().available


async def test_many_chains_go_first_in_chunks_then_one_input_switches(fake: FakeIptablesClient,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from usproxy.offload.iptables import family_rules

    monkeypatch.setattr(family_rules, "CHUNK", 2)
    dp = datapath(fake)
    states = {spn(f"s{i}"): state(spn(f"s{i}"), f"10.96.0.{i + 1}", 80, [ep(f"10.244.{i}.1")]) for i in range(7)}
    await dp.apply(states)
    inputs = [text for tool, text in fake.restores if tool.startswith("iptables-") and "PROBE" not in text]
    assert len(inputs) == 5  # 4 chunks of own chains (2+2+2+1 ServicePorts), then the switch
    for text in inputs[:-1]:
        assert ":KUBE-SERVICES" not in text and ":KUBE-MARK-MASQ - [0:0]" in text
    assert inputs[-1].count(":KUBE-SVC-") == 0 and ":KUBE-SERVICES - [0:0]" in inputs[-1]
    legacy = datapath(fake, backend="legacy")
    await legacy.apply(states)  # iptables-legacy replaces a whole table per COMMIT: one input
    assert len([t for tool, t in fake.restores if tool == "iptables-legacy-restore" and "PROBE" not in t]) == 1
    rs = dp.ruleset(4)
    assert rs is not None and rules.render_ruleset(rs) == explained(states)
    held = kube_chains(fake)
    for table in ("filter", "nat"):
        for chain, rs_rules in rules.ordered(rs, table):
            assert held[table][chain] == [" ".join(r.tokens) for r in rs_rules]


async def test_leftovers_name_what_this_mode_holds_in_either_backend(fake: FakeIptablesClient) -> None:
    fake.restore("nft", 4, "*filter\n:DOCKER-USER - [0:0]\nCOMMIT\n")  # another program's: not a leftover
    dp = datapath(fake)
    assert await dp.leftovers() == []
    await dp.read_back()
    fake.restore("legacy", 4, "*nat\n:KUBE-SVC-LEFTOVERFROMOLD1 - [0:0]\nCOMMIT\n")
    found = await dp.leftovers()
    assert [w.split(":")[0] for w in found] == ["iptables-nft IPv4", "iptables-nft IPv6", "iptables-legacy IPv4"]
    await dp.cleanup()
    assert await dp.leftovers() == []
