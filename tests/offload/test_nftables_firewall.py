"""loadBalancerSourceRanges in the nftables layout, without a kernel: the packet flows of
kube-proxy's TestLoadBalancer (pkg/proxy/nftables/proxier_test.go) traced through FakeNft, the
element-wise updates of the firewall map and chain, and read back adopting and repairing them.

kube-proxy's addresses, with its public ones moved to documentation ranges: LB IPs 1.2.3.4 and
5.6.7.8 become 198.51.100.1 and .2; the node 192.168.0.2, the ranges 192.168.0.0/24 and
" 203.0.113.0/25" (whitespace trimmed), the accepted client 203.0.113.2 and the blocked one
203.0.113.130 are kube-proxy's own."""

from __future__ import annotations

import copy
import ipaddress

import pytest

from usproxy.core.datapath import ServicePortState
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNft, FakeNftClient
from usproxy.offload.nftables.names import firewall_chain
from usproxy.offload.nftables.transaction import TableState, Transaction
from usproxy.model.source_ranges import parse_source_ranges

from tests.offload.helpers import ep, spn, state
from tests.offload.nft_trace import trace
from tests.offload.nftables_fakes import NoConntrack, UpdatePathOnly, install

SVC = spn("svc1", "p80", ns="ns1")
LB1, LB2 = "198.51.100.1", "198.51.100.2"
NODE_IP, POD = "192.168.0.2", "10.0.0.2"
ALLOWED, BLOCKED = "203.0.113.2", "203.0.113.130"
EP = "10.180.0.1:80"
LOCAL = [NODE_IP, LB1, LB2]


def lb(ranges: list[str], lbs: tuple[str, ...] = (LB1, LB2)) -> ServicePortState:
    return state(SVC, "172.30.0.41", 80, [ep("10.180.0.1", 80)], node_port=3001, service_type="LoadBalancer",
                 load_balancer_ips=tuple(ipaddress.ip_address(a) for a in lbs),
                 source_ranges=parse_source_ranges("Service ns1/svc1", "spec.loadBalancerSourceRanges", ranges))


KUBE_PROXY_RANGES = ["192.168.0.0/24", " 203.0.113.0/25"]


def v4(fake: FakeNft) -> object:
    """What the IPv4 table holds (read back may add an empty IPv6 table: not this test's business)."""
    t = fake.tables[4]
    return t.maps, t.sets, t.chains


@pytest.fixture
def fake() -> FakeNft:
    return FakeNft()


@pytest.fixture
def dp(fake: FakeNft) -> NftablesDatapath:
    return NftablesDatapath(FakeNftClient(fake), NoConntrack(), node_ips=lambda: [ipaddress.ip_address(NODE_IP)])


# (name, source, destination, port, expected: "DROP" or (endpoint, masqueraded))
FLOWS: list[tuple[str, str, str, int, tuple[str, bool] | str]] = [
    ("pod to cluster IP", POD, "172.30.0.41", 80, (EP, False)),
    ("external to nodePort", ALLOWED, NODE_IP, 3001, (EP, True)),
    ("nodePort bypasses LoadBalancerSourceRanges", BLOCKED, NODE_IP, 3001, (EP, True)),
    ("accepted external to LB1", ALLOWED, LB1, 80, (EP, True)),
    ("accepted external to LB2", ALLOWED, LB2, 80, (EP, True)),
    ("blocked external to LB1", BLOCKED, LB1, 80, "DROP"),
    ("blocked external to LB2", BLOCKED, LB2, 80, "DROP"),
    ("pod to LB1 (blocked by LoadBalancerSourceRanges)", POD, LB1, 80, "DROP"),
    ("pod to LB2 (blocked by LoadBalancerSourceRanges)", POD, LB2, 80, "DROP"),
    ("node to LB1 (allowed by LoadBalancerSourceRanges)", NODE_IP, LB1, 80, (EP, True)),
    ("node to LB2 (allowed by LoadBalancerSourceRanges)", NODE_IP, LB2, 80, (EP, True)),
    ("same node to LB1, SNATted to LB1 (implicitly allowed)", LB1, LB1, 80, (EP, True)),
    ("same node to LB2, SNATted to LB2 (implicitly allowed)", LB2, LB2, 80, (EP, True)),
]


@pytest.mark.parametrize(("name", "src", "dst", "port", "want"), FLOWS, ids=[f[0] for f in FLOWS])
async def test_kube_proxy_load_balancer_flows(fake: FakeNft, dp: NftablesDatapath, name: str, src: str,
                                              dst: str, port: int, want: tuple[str, bool] | str) -> None:
    await dp.apply({SVC: lb(KUBE_PROXY_RANGES)})
    got = trace(fake, 4, src, dst, "tcp", port, local=LOCAL)
    if isinstance(want, str):
        assert want == "DROP" and got.verdict == "drop"
    else:
        target, masq = want
        assert (got.verdict, set(got.targets), target in got.masq) == ("dnat", {target}, masq)


async def test_without_a_node_address_in_the_ranges_the_lb_ip_is_no_allowed_source(fake: FakeNft) -> None:
    dp = NftablesDatapath(FakeNftClient(fake), NoConntrack())  # node address unknown: kube-proxy's allowFromNode false
    await dp.apply({SVC: lb(KUBE_PROXY_RANGES)})
    assert trace(fake, 4, LB1, LB1, "tcp", 80, local=LOCAL).verdict == "drop"
    assert fake.tables[4].chains[firewall_chain(SVC)] == ["ip saddr != { 192.168.0.0/24, 203.0.113.0/25 } drop"]


async def test_layout_chain_and_map_elements(fake: FakeNft, dp: NftablesDatapath) -> None:
    await dp.apply({SVC: lb(KUBE_PROXY_RANGES)})
    t = fake.tables[4]
    chain = firewall_chain(SVC)
    assert t.maps["firewall-ips"] == {f"{a} . tcp . 80": (f"goto {chain}", "ns1/svc1:p80/TCP") for a in (LB1, LB2)}
    # the LB IPs are host routes in the set; overlapping ranges are collapsed (an interval set refuses them)
    assert t.chains[chain] == [f"ip saddr != {{ 192.168.0.0/24, {LB1}, {LB2}, 203.0.113.0/25 }} drop"]
    assert t.chains["filter-prerouting-pre-dnat"] == t.chains["filter-output-pre-dnat"] == [
        "ct state new jump firewall-check"]


@pytest.mark.parametrize("ranges", [[], ["0.0.0.0/0", "203.0.113.0/25"], ["2001:db8::/64"], ["not-a-cidr"]])
async def test_nothing_is_filtered_as_kube_proxy(fake: FakeNft, dp: NftablesDatapath, ranges: list[str]) -> None:
    """No ranges, a zero-length one (allow any), only other-family ones, or only invalid ones
    (ignored, logged): no firewall, as kube-proxy's per-family proxier."""
    await dp.apply({SVC: lb(ranges)})
    assert fake.tables[4].maps["firewall-ips"] == {}
    assert trace(fake, 4, BLOCKED, LB1, "tcp", 80, local=LOCAL).targets == {EP}


async def test_changes_are_element_wise_and_removal_leaves_nothing(fake: FakeNft, dp: NftablesDatapath) -> None:
    await dp.apply({SVC: lb(["203.0.113.0/25"])})
    chain = firewall_chain(SVC)
    await dp.apply({SVC: lb(["203.0.113.128/25"])})  # ranges change: the chain is rewritten, the elements stay
    assert trace(fake, 4, BLOCKED, LB1, "tcp", 80, local=LOCAL).targets == {EP}
    assert trace(fake, 4, ALLOWED, LB1, "tcp", 80, local=LOCAL).verdict == "drop"
    await dp.apply({SVC: lb(["203.0.113.128/25"], (LB1,))})  # an LB IP goes: its element goes
    assert set(fake.tables[4].maps["firewall-ips"]) == {f"{LB1} . tcp . 80"}
    await dp.apply({SVC: lb([], (LB1,))})  # no ranges any more: element and chain deleted
    assert fake.tables[4].maps["firewall-ips"] == {} and chain not in fake.tables[4].chains
    await dp.apply({SVC: lb(["203.0.113.0/25"])})
    await dp.apply({SVC: None})
    assert fake.tables[4].maps["firewall-ips"] == {} and chain not in fake.tables[4].chains


async def test_read_back_adopts_the_firewall_and_repairs_drift(fake: FakeNft, dp: NftablesDatapath) -> None:
    states = {SVC: lb(KUBE_PROXY_RANGES)}
    await dp.apply(states)
    intact = copy.deepcopy(v4(fake))
    again = NftablesDatapath(FakeNftClient(fake), NoConntrack(), node_ips=lambda: [ipaddress.ip_address(NODE_IP)])
    await again.read_back()
    assert again.tables[4].rules == dp.tables[4].rules
    await again.apply(states)
    assert v4(fake) == intact
    fake.tables[4].chains[firewall_chain(SVC)] = []  # flushed behind our back: the firewall is open
    assert trace(fake, 4, BLOCKED, LB1, "tcp", 80, local=LOCAL).targets == {EP}
    await again.read_back()
    await again.apply(states)
    assert v4(fake) == intact
    del fake.tables[4].maps["firewall-ips"][f"{LB2} . tcp . 80"]  # an element deleted behind our back
    await again.read_back()
    await again.apply(states)
    assert v4(fake) == intact
    assert trace(fake, 4, BLOCKED, LB2, "tcp", 80, local=LOCAL).verdict == "drop"


async def test_elements_of_no_service_port_are_deleted_after_read_back(fake: FakeNft, dp: NftablesDatapath) -> None:
    await dp.apply({SVC: lb(KUBE_PROXY_RANGES)})
    again = NftablesDatapath(FakeNftClient(fake), NoConntrack())
    await again.read_back()
    await again.apply({SVC: None})  # the Service went away while the agent was down
    assert fake.tables[4].maps["firewall-ips"] == {}
    assert trace(fake, 4, BLOCKED, LB1, "tcp", 80, local=LOCAL).verdict == "none"


def test_first_install_and_update_path_build_the_same_firewall() -> None:
    fast, slow = FakeNft(), FakeNft()
    fast_tables: dict[int, TableState] = {}
    slow_tables: dict[int, TableState] = {}
    install(Transaction, {SVC: lb(KUBE_PROXY_RANGES)}, fast, fast_tables)
    install(UpdatePathOnly, {SVC: lb(KUBE_PROXY_RANGES)}, slow, slow_tables)
    assert fast.tables[4].maps["firewall-ips"] and fast.dump() == slow.dump()
    assert fast_tables == slow_tables


async def test_ipv6_ranges_filter_the_ipv6_lb_ip_only(fake: FakeNft, dp: NftablesDatapath) -> None:
    """Dual-stack: each family's LB IP is filtered by that family's ranges only; an IPv4 LB IP with
    only IPv6 ranges is not filtered (kube-proxy's per-family proxiers)."""
    ips = (ipaddress.ip_address("10.96.0.9"), ipaddress.ip_address("2001:db8:96::9"))
    st = state(SVC, "10.96.0.9", 80, [ep("10.244.1.1", 80), ep("2001:db8:244::1", 80)], cluster_ips=ips,
               service_type="LoadBalancer", node_port=3001,
               load_balancer_ips=(ipaddress.ip_address(LB1), ipaddress.ip_address("2001:db8:51::1")),
               source_ranges=(ipaddress.ip_network("2001:db8:113::/64"),))
    await dp.apply({SVC: st})
    assert trace(fake, 6, "2001:db8:113::7", "2001:db8:51::1", "tcp", 80).targets == {"[2001:db8:244::1]:80"}
    assert trace(fake, 6, "2001:db8:114::7", "2001:db8:51::1", "tcp", 80).verdict == "drop"
    assert fake.tables[6].chains[firewall_chain(SVC)] == ["ip6 saddr != { 2001:db8:113::/64 } drop"]
    assert trace(fake, 4, BLOCKED, LB1, "tcp", 80).targets == {"10.244.1.1:80"}
    assert fake.tables[4].maps["firewall-ips"] == {}
