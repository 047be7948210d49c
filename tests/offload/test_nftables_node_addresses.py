"""The nftables layout's node facts over FakeNft, judged by the tests' tracer: NodePorts only on
the addresses --nodeport-addresses admits (set nodeport-ips, kept up to date from the local
addresses, read back after a restart), and new connections to an unallocated address of the
Service CIDRs dropped (chain cluster-ips-check), as kube-proxy's nftables mode
(pkg/proxy/nftables/proxier.go setupNFTables)."""

from __future__ import annotations

import ipaddress

from usproxy.core.datapath import ServicePortState
from usproxy.model.node import LocalAddresses, NodeFacts
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNft, FakeNftClient
from usproxy.model.types import ServicePortName

from tests.offload.helpers import ep, spn, state
from tests.offload.nft_trace import trace
from tests.offload.nftables_fakes import NoConntrack

WEB = spn("web", "http")
NODE = ["192.0.2.10", "192.0.2.11"]


class Addresses:
    """The local addresses the datapath reads; a test changes them as interfaces would."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.pairs = list(pairs)
        self.reads = 0

    async def __call__(self) -> LocalAddresses:
        self.reads += 1
        return [(name, ipaddress.ip_address(a)) for name, a in self.pairs]


def datapath(fake: FakeNft, addrs: Addresses, cidrs: tuple[str, ...] = (), services: tuple[str, ...] = ()) -> NftablesDatapath:
    node = NodeFacts("node", tuple(ipaddress.ip_network(c) for c in cidrs))
    return NftablesDatapath(FakeNftClient(fake), NoConntrack(), node=node, addresses=addrs,
                            service_cidrs=tuple(ipaddress.ip_network(c) for c in services))


def web(*eps: str) -> dict[ServicePortName, ServicePortState | None]:
    return {WEB: state(WEB, "10.96.0.1", 80, [ep(e) for e in eps], node_port=30080, service_type="NodePort")}


async def test_nodeports_only_on_the_admitted_addresses() -> None:
    fake = FakeNft()
    addrs = Addresses(("usbr0", "192.0.2.10"), ("usbr0", "192.0.2.11"), ("lo", "127.0.0.1"), ("usproxy0", "10.96.0.1"))
    dp = datapath(fake, addrs, ("192.0.2.10/32",))
    await dp.read_back()  # the first full sync: both families' tables
    await dp.apply(web("10.244.1.1"))
    assert fake.tables[4].sets["nodeport-ips"] == {"192.0.2.10"}
    assert trace(fake, 4, "203.0.113.1", "192.0.2.10", "tcp", 30080, local=NODE).targets == {"10.244.1.1:8080"}
    assert trace(fake, 4, "203.0.113.1", "192.0.2.11", "tcp", 30080, local=NODE).verdict == "none"
    # without endpoints: rejected on the admitted address only (nodeport-ips in endpoints-check too)
    await dp.apply(web())
    assert trace(fake, 4, "203.0.113.1", "192.0.2.10", "tcp", 30080, local=NODE).verdict == "reject"
    assert trace(fake, 4, "203.0.113.1", "192.0.2.11", "tcp", 30080, local=NODE).verdict == "none"
    # IPv6 has no CIDR: every local IPv6 address serves NodePorts (kube-proxy, per family)
    assert "fib daddr type local" in " ".join(fake.tables[6].chains["services"])


async def test_default_is_every_local_address() -> None:
    fake = FakeNft()
    addrs = Addresses(("usbr0", "192.0.2.10"), ("usbr0", "192.0.2.11"))
    dp = datapath(fake, addrs)
    await dp.apply(web("10.244.1.1"))
    assert addrs.reads == 0 and not fake.tables[4].sets["nodeport-ips"]
    for addr in NODE:
        assert trace(fake, 4, "203.0.113.1", addr, "tcp", 30080, local=NODE).targets == {"10.244.1.1:8080"}


async def test_addresses_that_come_and_go_are_followed_at_the_next_write() -> None:
    fake = FakeNft()
    addrs = Addresses(("usbr0", "192.0.2.10"))
    dp = datapath(fake, addrs, ("192.0.2.0/24",))
    await dp.apply(web("10.244.1.1"))
    assert fake.tables[4].sets["nodeport-ips"] == {"192.0.2.10"}
    addrs.pairs = [("usbr0", "192.0.2.11"), ("eth1", "198.51.100.7")]
    await dp.apply(web("10.244.1.1", "10.244.2.1"))
    assert fake.tables[4].sets["nodeport-ips"] == {"192.0.2.11"}
    # a restarted agent reads the set back and changes nothing while the addresses stay
    again = datapath(fake, addrs, ("192.0.2.0/24",))
    await again.read_back()
    assert again.tables[4].nodeport_ips == {"192.0.2.11"}
    before, n = fake.dump(), fake.transactions
    await again.apply(web("10.244.1.1", "10.244.2.1"))
    assert fake.dump() == before and fake.transactions == n  # nothing to send


async def test_unallocated_service_addresses_are_dropped() -> None:
    fake = FakeNft()
    dp = datapath(fake, Addresses(), services=("10.96.0.0/16", "2001:db8:96::/112"))
    await dp.read_back()
    await dp.apply(web("10.244.1.1"))
    vip = ["10.96.0.1"]  # the relay holds allocated ClusterIPs on the ClusterIP interface
    assert trace(fake, 4, "10.244.9.9", "10.96.0.1", "tcp", 80, local=vip).targets == {"10.244.1.1:8080"}
    assert trace(fake, 4, "10.244.9.9", "10.96.99.99", "tcp", 80, local=vip).verdict == "drop"
    assert trace(fake, 4, "10.244.9.9", "10.96.99.99", "udp", 53, local=vip).verdict == "drop"
    assert trace(fake, 4, "10.244.9.9", "10.96.0.1", "tcp", 81, local=vip).verdict == "none"  # the kernel refuses
    assert trace(fake, 4, "10.244.9.9", "10.97.0.1", "tcp", 80, local=vip).verdict == "none"  # outside: routed
    assert trace(fake, 6, "2001:db8:244::9", "2001:db8:96::99", "tcp", 80).verdict == "drop"
    plain = FakeNft()
    await datapath(plain, Addresses()).apply(web("10.244.1.1"))
    assert "cluster-ips-check" not in plain.tables[4].chains
    assert trace(plain, 4, "10.244.9.9", "10.96.99.99", "tcp", 80).verdict == "none"
