"""/flows rows of the nftables datapath without a kernel: a ServicePort taken out of the table
(a demotion, a removal) keeps its kernel flows on their conntrack entries, so they stay listed
until none is left (README, "Live flows at the handover")."""

from __future__ import annotations

from collections.abc import Mapping

from usproxy.offload.kernel_conntrack import FrontendKey, KernelConntrack
from usproxy.offload.nftables.datapath import NftablesDatapath
from usproxy.offload.nftables.fake import FakeNftClient
from usproxy.util.rows import FlowRow

from tests.offload.helpers import ep, spn, state

WEB = spn("web", "http")
FRONTEND: FrontendKey = ("10.96.0.1", "TCP", 80)


class LiveEntries(KernelConntrack):
    """Conntrack holding one DNATed entry to FRONTEND while `live`; records what was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.live = True
        self.asked: list[dict[FrontendKey, str]] = []

    def flows(self, frontends: Mapping[FrontendKey, str], datapath: str, timeout: float = 5.0) -> list[FlowRow]:
        self.asked.append(dict(frontends))
        if not self.live or FRONTEND not in frontends:
            return []
        return [{"protocol": "TCP", "state": "ESTABLISHED", "age": None, "idle": None,
                 "original": {"src": "10.244.9.9:40000", "dst": "10.96.0.1:80"},
                 "reply": {"src": "10.244.1.1:8080", "dst": "10.244.9.9:40000"}, "packets_in": 1,
                 "bytes_in": 60, "packets_out": 1, "bytes_out": 60, "datapath": datapath,
                 "service": frontends[FRONTEND]}]


async def test_a_removed_service_ports_kernel_flows_are_listed_until_they_end() -> None:
    ct = LiveEntries()
    dp = NftablesDatapath(FakeNftClient(), ct)
    try:
        await dp.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
        assert [r["service"] for r in dp.flows_view()] == [WEB.key()]
        await dp.apply({WEB: None})  # demoted: the rules go, the connection runs on its entry
        assert dp.frontends() == {}
        assert [r["service"] for r in dp.flows_view()] == [WEB.key()]
        ct.live = False  # the connection ended
        assert dp.flows_view() == []
        ct.live = True  # forgotten: no longer asked about
        assert dp.flows_view() == [] and ct.asked[-1] == {}
    finally:
        dp.close()
