"""What each kernel datapath sends to the kernel, counted by the datapath itself
(KernelWriteCounter) and shown as usproxy_kernel_writes_total{datapath, unit}: what `usproxy
tour` reads for an update's cost. Without a kernel: the nftables and iptables datapaths over their
fakes, whose record of what arrived is the reference (the BPF datapath's count is tested with a
kernel, tests/offload/bpf/test_kernel_writes.py)."""

from __future__ import annotations

from usproxy.core.datapath import ServicePortState
from usproxy.model.node import NodeFacts
from usproxy.model.types import ServicePortName
from usproxy.offload.fake import FakeKernelDatapath
from usproxy.offload.iptables.datapath import IptablesDatapath
from usproxy.offload.iptables.fake import FakeIptablesClient
from usproxy.offload.manager import OffloadManager
from usproxy.offload.nftables.commands import Command, operations
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNft, FakeNftClient
from usproxy.offload.settings import OffloadSettings
from usproxy.util.errors import OffloadError
from usproxy.util.metrics import Metrics

from pathlib import Path

from tests.offload.helpers import ep, spn, state
from tests.offload.iptables.test_datapath import NoConntrack as NoIptablesConntrack
from tests.offload.nftables_fakes import NoConntrack

WEB = spn("web", "http")


def services(n: int) -> dict[ServicePortName, ServicePortState]:
    """`web` and n - 1 others, two endpoints each."""
    out = {WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1"), ep("10.244.1.2")])}
    for i in range(n - 1):
        name = spn(f"s{i}", "http")
        out[name] = state(name, f"10.96.{1 + i // 250}.{i % 250 + 1}", 80,
                          [ep(f"10.244.{100 + i // 250}.{i % 250 + 1}"), ep(f"10.244.{150 + i // 250}.{i % 250 + 1}")])
    return out


def replaced() -> ServicePortState:
    """`web` with its second endpoint replaced by another."""
    return state(WEB, "10.96.0.1", 80, [ep("10.244.1.1"), ep("10.244.1.3")])


class RecordingNftClient(FakeNftClient):
    """FakeNftClient that keeps every transaction it was sent."""

    def __init__(self, nft: FakeNft) -> None:
        super().__init__(nft)
        self.sent: list[list[Command]] = []
        self.refuse = False

    async def apply(self, commands: object) -> None:
        if self.refuse:
            raise OffloadError("refused")
        self.sent.append(list(commands))  # type: ignore[call-overload]
        await super().apply(self.sent[-1])


async def nft_change_cost(n: int) -> tuple[int, int]:
    """(the datapath's count for one endpoint change among n Services, the operations sent)."""
    client = RecordingNftClient(FakeNft())
    dp = NftablesDatapath(client, NoConntrack())
    await dp.apply(services(n))
    assert dp.kernel_writes() == sum(operations(tx) for tx in client.sent)
    before, sent_before = dp.kernel_writes(), len(client.sent)
    await dp.apply({WEB: replaced()})
    return dp.kernel_writes() - before, sum(operations(tx) for tx in client.sent[sent_before:])


async def test_nftables_counts_the_operations_it_sent_and_an_endpoint_change_costs_the_same_at_any_size() -> None:
    small, sent_small = await nft_change_cost(2)
    large, sent_large = await nft_change_cost(300)
    assert small == sent_small and large == sent_large
    # the replaced endpoint's slot element and its hairpin element (an endpoint without a
    # nodeName may be on this node), each deleted and added
    assert small == large == 4
    assert operations([Command("add", "element", 4, "slot-0", elems=())]) == 0


async def test_nftables_counts_nothing_for_a_refused_transaction() -> None:
    client = RecordingNftClient(FakeNft())
    dp = NftablesDatapath(client, NoConntrack())
    await dp.apply(services(3))
    before = dp.kernel_writes()
    client.refuse = True
    try:
        await dp.apply({WEB: replaced()})
    except OffloadError:
        pass
    assert dp.kernel_writes() == before


async def ipt_change_cost(n: int) -> tuple[int, int]:
    """(the datapath's count for one endpoint change among n Services, the restore lines sent)."""
    fake = FakeIptablesClient()
    dp = IptablesDatapath(fake, NoIptablesConntrack(), node=NodeFacts("node"))
    await dp.apply(services(n))
    sent = len(fake.restores)
    before = dp.kernel_writes()
    await dp.apply({WEB: replaced()})
    lines = sum(text.count("\n") for cmd, text in fake.restores[sent:] if "restore" in cmd)
    return dp.kernel_writes() - before, lines


async def test_iptables_counts_its_restore_lines_and_an_endpoint_change_grows_with_the_services() -> None:
    small, sent_small = await ipt_change_cost(2)
    large, sent_large = await ipt_change_cost(300)
    assert small == sent_small > 0 and large == sent_large
    # kube-proxy's partial sync rewrites KUBE-SERVICES: one more rule per ServicePort
    assert large - small == 298


class CountingKernel(FakeKernelDatapath):
    write_unit = "fake writes"

    def kernel_writes(self) -> int:
        return 7 * len(self.applies)


async def test_the_metric_shows_each_counting_datapath_in_its_unit() -> None:
    metrics = Metrics()
    counting, silent = CountingKernel("bpf"), FakeKernelDatapath("nftables")
    mgr = OffloadManager(OffloadSettings("auto", 0.0, "random", Path("/nonexistent")), [counting, silent],
                         request_sync=lambda: None, metrics=metrics)
    await counting.apply({WEB: replaced()})
    await counting.apply({WEB: None})
    value = metrics.registry.get_sample_value("usproxy_kernel_writes_total", {"datapath": "bpf", "unit": "fake writes"})
    assert value == 14
    assert metrics.registry.get_sample_value("usproxy_kernel_writes_total", {"datapath": "nftables", "unit": ""}) is None
    await mgr.close()
