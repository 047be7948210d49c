"""Service CIDRs from ServiceCIDR objects in the nftables datapath, over FakeNft and judged by the
tests' tracer: a change of the objects' CIDRs rewrites chain `cluster-ips-check` (and the jumps
to it) in the next transaction, always together with --service-cidr, as kube-proxy's nftables
mode rewrites the chain at its next sync (pkg/proxy/nftables/proxier.go OnServiceCIDRsChanged,
setupNFTables); through the Proxier and the OffloadManager the change makes the next sync a full
one, which rewrites the chain even when no ServicePort changes."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from usproxy.core.datapath import ServicePortState
from usproxy.model.node import NodeFacts
from usproxy.offload.manager import OffloadManager
from usproxy.offload.settings import OffloadSettings
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNft, FakeNftClient
from usproxy.core.proxier import Proxier
from usproxy.model.types import Family, IPNetwork, ServicePortName

from tests.offload.helpers import ep, spn, state
from tests.offload.nft_trace import trace
from tests.offload.nftables_fakes import NoConntrack

WEB = spn("web", "http")
VIP = ["10.96.0.1"]  # the relay holds allocated ClusterIPs on the ClusterIP interface


def nets(*texts: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(t) for t in texts)


def datapath(fake: FakeNft, *flag: str) -> NftablesDatapath:
    return NftablesDatapath(FakeNftClient(fake), NoConntrack(), node=NodeFacts("node"), service_cidrs=nets(*flag))


def web(*eps: str) -> dict[ServicePortName, ServicePortState | None]:
    return {WEB: state(WEB, "10.96.0.1", 80, [ep(e) for e in eps])}


def verdict(fake: FakeNft, dst: str, family: Family = 4) -> str:
    src = "10.244.9.9" if family == 4 else "2001:db8:244::9"
    return trace(fake, family, src, dst, "tcp", 80, local=VIP if family == 4 else ()).verdict


async def test_object_cidrs_join_the_flag_and_a_change_rewrites_the_chain() -> None:
    fake = FakeNft()
    dp = datapath(fake, "10.96.0.0/16")
    await dp.read_back()
    await dp.apply(web("10.244.1.1"))
    assert verdict(fake, "10.100.0.9") == "none"  # not a Service CIDR yet: routed on
    dp.on_service_cidrs_changed(nets("10.100.0.0/16", "2001:db8:96::/112"))
    await dp.apply(web("10.244.1.1", "10.244.1.2"))  # the next transaction, not a full sync
    assert fake.tables[4].chains["cluster-ips-check"][-1] == "ip daddr { 10.96.0.0/16, 10.100.0.0/16 } drop"
    assert verdict(fake, "10.100.0.9") == "drop"
    assert verdict(fake, "10.96.99.99") == "drop"  # --service-cidr stays in force
    assert trace(fake, 4, "10.244.9.9", "10.96.0.1", "tcp", 80, local=VIP).targets == {"10.244.1.1:8080", "10.244.1.2:8080"}
    # IPv6 holds no ServicePort, so no transaction touched it: the full sync adds chain and jumps
    assert verdict(fake, "2001:db8:96::99", 6) == "none"
    await dp.read_back()
    assert verdict(fake, "2001:db8:96::99", 6) == "drop"
    assert verdict(fake, "10.100.0.9") == "drop"
    # the object goes away: back to the flag's CIDR alone, IPv6 unchecked again
    dp.on_service_cidrs_changed(())
    await dp.read_back()  # the full sync the Proxier asks for
    assert verdict(fake, "10.100.0.9") == "none"
    assert verdict(fake, "10.96.99.99") == "drop"
    assert verdict(fake, "2001:db8:96::99", 6) == "none"


async def test_an_unchanged_set_leaves_the_table_alone() -> None:
    fake = FakeNft()
    dp = datapath(fake, "10.96.0.0/16")
    await dp.read_back()
    await dp.apply(web("10.244.1.1"))
    n = fake.transactions
    dp.on_service_cidrs_changed(nets("10.96.0.0/24"))  # inside the flag's CIDR: the same check
    await dp.apply(web("10.244.1.1"))
    assert fake.transactions == n


async def test_proxier_change_reaches_the_kernel_at_the_next_sync_without_service_changes() -> None:
    fake = FakeNft()
    dp = datapath(fake)
    mgr = OffloadManager(OffloadSettings("nftables", 0.0, "roundRobin", Path("/nonexistent")), [dp],
                         request_sync=lambda: None)
    proxier = Proxier([mgr])
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    await proxier.sync()  # the first (full) sync: the table's fixed part, no ServicePort
    assert "cluster-ips-check" not in fake.tables[4].chains
    proxier.on_service_cidrs_changed(nets("10.100.0.0/16"))
    await proxier.sync()
    assert verdict(fake, "10.100.0.9") == "drop"
    assert verdict(fake, "10.101.0.9") == "none"
    await mgr.close()
