"""OffloadManager with FakeKernelDatapaths: the window, promotion, diffs, demotion (failure,
unsupported, annotation), restart adoption, BPF + nftables by traffic kind, timers, metric labels
from structured reasons, a wake-up that is no source change, and dump()."""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Mapping
from pathlib import Path

from usproxy.util.metrics import Metrics
from usproxy.app.cleanup import remove_kernel_state
from usproxy.model.config import ProxyConfig
from usproxy.offload.kernel_datapath import Capability, KernelDatapathDeclaration, TrafficKind
from usproxy.core.datapath import Placement, ServicePortState, SyncRequest
from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import OffloadError
from usproxy.offload.fake import FakeKernelDatapath
from usproxy.offload.manager import OffloadManager
from usproxy.offload.settings import OffloadSettings
from usproxy.offload.stale_cleanup import MAX_PASSES
from usproxy.core.stale_udp import StaleUdp, packed
from usproxy.model.types import ServicePortName

from tests.offload.helpers import ep, spn, state

A, B = spn("web", "http"), spn("api")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def settings(after: float) -> OffloadSettings:
    return OffloadSettings("auto", after, "roundRobin", Path("/nonexistent"))


def make(*kernels: FakeKernelDatapath, after: float = 5.0) -> tuple[OffloadManager, Clock, Metrics]:
    clock, metrics = Clock(), Metrics()
    mgr = OffloadManager(settings(after), list(kernels), request_sync=lambda: None, metrics=metrics, clock=clock)
    return mgr, clock, metrics


def web(*ips: str, **kw: object) -> ServicePortState:
    return state(A, "10.96.0.1", 80, [ep(i) for i in ips], **kw)


def req(*states: ServicePortState, full: bool = False) -> SyncRequest:
    return SyncRequest({s.service_port.name: s for s in states}, full=full)


def demotions(metrics: Metrics, datapath: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("usproxy_offload_demotions_total",
                                              {"datapath": datapath, "reason": reason})
    return value or 0.0


async def test_promotes_only_after_the_window() -> None:
    nft = FakeKernelDatapath()
    mgr, clock, _ = make(nft)
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2"), full=True))
    assert nft.installed == {}
    clock.now += 2.1
    p = mgr.placement(A)
    assert p is not None and (p.datapath, p.reason) == ("userspace", "establishing: 2.1s of 5.0s")
    clock.now += 2.9
    await mgr.sync(SyncRequest({}))
    assert set(nft.installed) == {A}
    clock.now += 5.0
    p = mgr.placement(A)
    assert p is not None and (p.datapath, p.reason) == ("nftables", "established 5.0s ago")


async def test_endpoint_change_restarts_window_only_before_offload() -> None:
    nft = FakeKernelDatapath()
    mgr, clock, _ = make(nft)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    clock.now += 4
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2")))
    clock.now += 4  # 8 s after the first sight, 4 s after the change: not yet
    await mgr.sync(SyncRequest({}))
    assert nft.installed == {}
    clock.now += 1
    await mgr.sync(SyncRequest({}))
    assert A in nft.installed
    # once offloaded, changes go to the kernel at once, as one diff
    await mgr.sync(req(web("10.244.1.3")))
    assert nft.installed[A].cluster_endpoints == (ep("10.244.1.3"),)
    assert nft.applies[-1] == {A: web("10.244.1.3")}


async def test_annotation_pins_to_userspace() -> None:
    nft = FakeKernelDatapath()
    mgr, clock, _ = make(nft, after=0)
    await mgr.sync(req(web("10.244.1.1", datapath="userspace"), full=True))
    assert nft.installed == {}
    p = mgr.placement(A)
    assert p is not None and p.datapath == "userspace" and p.reason.startswith("pinned by annotation")


async def test_unsupported_feature_is_demoted_with_reason_and_metric() -> None:
    nft = FakeKernelDatapath(unsupported_if=lambda st: "SCTP is served by the relay only"
                             if st.service_port.protocol == "SCTP" else None)
    mgr, _, metrics = make(nft, after=0)
    sctp = state(spn("sig", proto="SCTP"), "10.96.0.9", 9, [ep("10.244.1.1")])
    await mgr.sync(SyncRequest({sctp.service_port.name: sctp, A: web("10.244.1.1")}, full=True))
    assert set(nft.installed) == {A}
    p = mgr.placement(sctp.service_port.name)
    assert p is not None and p.datapath == "userspace"
    assert p.reason == "demoted: nftables: SCTP is served by the relay only"
    assert demotions(metrics, "nftables", "unsupported") == 1
    await mgr.sync(SyncRequest({}))  # counted once, not per sync
    assert demotions(metrics, "nftables", "unsupported") == 1


async def test_failed_apply_demotes_only_the_failing_service_port() -> None:
    nft = FakeKernelDatapath()
    mgr, clock, metrics = make(nft, after=1)
    b = state(B, "10.96.0.2", 80, [ep("10.244.2.1")])
    await mgr.sync(SyncRequest({A: web("10.244.1.1"), B: b}, full=True))
    nft.fail_spns = {A}
    clock.now += 1
    await mgr.sync(SyncRequest({}))
    assert set(nft.installed) == {B}
    pa, pb = mgr.placement(A), mgr.placement(B)
    assert pa is not None and pa.datapath == "userspace" and pa.reason.startswith("demoted: nftables: refused")
    assert pb is not None and pb.datapath == "nftables"
    assert demotions(metrics, "nftables", "apply_failed") == 1
    # retried after another window, and succeeds once the kernel accepts it
    nft.fail_spns = set()
    await mgr.sync(SyncRequest({}))
    assert A not in nft.installed
    clock.now += 1
    await mgr.sync(SyncRequest({}))
    assert set(nft.installed) == {A, B}


async def test_failure_of_an_offloaded_update_removes_it_from_the_kernel() -> None:
    nft = FakeKernelDatapath()
    mgr, clock, _ = make(nft, after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    assert A in nft.installed
    nft.fail_next = 1
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2")))
    assert A not in nft.installed  # new connections reach the relay again
    p = mgr.placement(A)
    assert p is not None and p.reason == "demoted: nftables: injected failure (errno 16)"


async def test_metric_labels_come_from_the_fault_not_from_its_wording() -> None:
    """A refusal whose message says "unavailable" and names another datapath is counted once,
    as apply_failed of the datapath that refused it."""
    class Busy(FakeKernelDatapath):
        async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
            if any(st is not None for st in changes.values()):
                raise OffloadError("bpf-style map update: Resource temporarily unavailable", errno.EAGAIN)
            await super().apply(changes)

    bpf, nft = FakeKernelDatapath("bpf", frozenset({"local"})), Busy()
    mgr, _, metrics = make(bpf, nft, after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    p = mgr.placement(A)
    assert p is not None and (p.datapath, p.reason) == (
        "userspace", "demoted: nftables: bpf-style map update: Resource temporarily unavailable (errno 11)")
    assert A not in bpf.installed  # taken out of every kernel, not only the one that refused
    assert demotions(metrics, "nftables", "apply_failed") == 1
    assert demotions(metrics, "nftables", "unavailable") == 0
    assert demotions(metrics, "bpf", "apply_failed") == demotions(metrics, "bpf", "unavailable") == 0


async def test_unsupported_everywhere_names_each_datapath_once() -> None:
    def no_sctp(st: ServicePortState) -> str | None:
        return "SCTP is served by the relay only" if st.service_port.protocol == "SCTP" else None

    bpf = FakeKernelDatapath("bpf", frozenset({"local"}), unsupported_if=no_sctp)
    nft = FakeKernelDatapath(unsupported_if=no_sctp)
    mgr, _, metrics = make(bpf, nft, after=0)
    sctp = state(spn("sig", proto="SCTP"), "10.96.0.9", 9, [ep("10.244.1.1")])
    await mgr.sync(req(sctp, full=True))
    p = mgr.placement(sctp.service_port.name)
    assert p is not None and p.reason == ("demoted: bpf: SCTP is served by the relay only; "
                                          "nftables: SCTP is served by the relay only")
    assert demotions(metrics, "bpf", "unsupported") == demotions(metrics, "nftables", "unsupported") == 1


async def test_annotation_naming_an_unconfigured_datapath_blames_that_datapath() -> None:
    bpf = FakeKernelDatapath("bpf", frozenset({"local"}))
    mgr, _, metrics = make(bpf, after=0)
    await mgr.sync(req(web("10.244.1.1", datapath="nftables"), full=True))
    p = mgr.placement(A)
    assert p is not None and (p.datapath, p.reason) == ("userspace", "demoted: nftables not configured")
    assert demotions(metrics, "nftables", "unavailable") == 1 and demotions(metrics, "bpf", "unavailable") == 0
    assert bpf.installed == {}


async def test_no_kernel_datapath_at_all_is_counted_as_none() -> None:
    mgr, _, metrics = make(after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    p = mgr.placement(A)
    assert p is not None and p.reason == "demoted: no kernel datapath configured"
    assert demotions(metrics, "none", "unavailable") == 1


async def test_restart_adopts_installed_service_ports_without_a_window() -> None:
    nft = FakeKernelDatapath()
    gone = state(B, "10.96.0.2", 80, [ep("10.244.2.1")])
    nft.installed = {A: web("10.244.1.1", "10.244.1.2"), B: gone}
    mgr, _, _ = make(nft, after=30)
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2"), full=True))
    assert set(nft.installed) == {A}  # B is no longer in the source
    p = mgr.placement(A)
    assert p is not None and p.datapath == "nftables"
    assert nft.applies == [{B: None, A: web("10.244.1.1", "10.244.1.2")}]


async def test_a_periodic_read_back_keeps_the_established_age() -> None:
    """Every full sync reads the kernel back (drift repair); a ServicePort it finds where it was
    keeps its age in /services (it was reset every 5 minutes, at each periodic full sync)."""
    nft = FakeKernelDatapath()
    mgr, clock, _ = make(nft, after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    clock.now += 300
    await mgr.sync(req(web("10.244.1.1"), full=True))
    p = mgr.placement(A)
    assert p is not None and p.datapath == "nftables" and p.reason.startswith("established 300.0s ago"), p


async def test_nothing_touches_the_kernel_before_the_first_sync_and_close_keeps_it() -> None:
    nft = FakeKernelDatapath()
    nft.installed = {A: web("10.244.1.1")}
    mgr, _, _ = make(nft)
    await mgr.close()
    assert nft.closed and A in nft.installed
    assert await remove_kernel_state(ProxyConfig(), [declared(nft)])  # `usproxy run --cleanup`, cleanup.py
    assert nft.cleaned and nft.installed == {}


async def test_cleanup_goes_on_past_a_failing_datapath_and_says_so() -> None:
    class Failing(FakeKernelDatapath):
        async def cleanup(self) -> None:
            raise OSError("EPERM")

    bad, nft = Failing("bpf"), FakeKernelDatapath()
    nft.installed = {A: web("10.244.1.1")}
    assert not await remove_kernel_state(ProxyConfig(), [declared(bad), declared(nft)])
    assert bad.closed and nft.cleaned and nft.closed and nft.installed == {}


def declared(k: FakeKernelDatapath) -> KernelDatapathDeclaration:
    """A declaration whose removal is `k`'s cleanup, as the real ones build, clean up and close."""
    async def remove(cfg: ProxyConfig) -> None:
        try:
            await k.cleanup()
        finally:
            k.close()

    async def nothing(cfg: ProxyConfig) -> list[str]:
        return []

    return KernelDatapathDeclaration(k.name, "fake", k.traffic, frozenset({"random", "roundRobin"}),  # type: ignore[arg-type]
                                     build=lambda ctx: k, probes=lambda cfg: [k.probe()], leftovers=nothing,
                                     remove=remove)


async def test_bpf_serves_local_and_nftables_forwarded() -> None:
    bpf = FakeKernelDatapath("bpf", frozenset({"local"}))
    nft = FakeKernelDatapath()
    mgr, _, _ = make(bpf, nft, after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    assert A in bpf.installed and A in nft.installed
    p = mgr.placement(A)
    assert p is not None and p.datapath == "bpf+nftables"


async def test_bpf_alone_leaves_forwarded_traffic_to_the_relay() -> None:
    bpf = FakeKernelDatapath("bpf", frozenset({"local"}))
    nft = FakeKernelDatapath(available=False)
    mgr, _, _ = make(bpf, nft, after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    p = mgr.placement(A)
    assert p is not None and p.datapath == "bpf" and p.reason.endswith("forwarded traffic via userspace")
    assert nft.installed == {}


async def test_no_kernel_datapath_says_why() -> None:
    mgr, _, metrics = make(FakeKernelDatapath(available=False), after=0)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    p = mgr.placement(A)
    assert p is not None and p.reason == "demoted: nftables unavailable: fake: switched off"
    assert demotions(metrics, "nftables", "unavailable") == 1


async def test_wakes_the_sync_when_the_window_ends() -> None:
    nft = FakeKernelDatapath()
    woke = asyncio.Event()
    mgr = OffloadManager(settings(0.05), [nft], request_sync=woke.set)
    await mgr.sync(req(web("10.244.1.1"), full=True))
    await asyncio.wait_for(woke.wait(), 2)
    await mgr.sync(SyncRequest({}))
    assert A in nft.installed
    await mgr.close()


async def test_conntrack_cleanup_never_holds_the_sync() -> None:
    """Control plane behind conntrack cleanup (issue 18 item 4): a cleanup that takes minutes (a
    dump of 150,000 entries) runs beside the syncs. Each sync's cleanup starts at once, up to
    MAX_PASSES at a time, so none waits behind another (issue 29 item 8); what is removed while
    every slot is busy is merged into the next pass."""
    release = asyncio.Event()

    class SlowCleanup(FakeKernelDatapath):
        started: list[dict[ServicePortName, frozenset[Endpoint]]] = []

        async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
            self.started.append(dict(removed))
            await release.wait()
            self.cleared.append(dict(removed))

    nft = SlowCleanup()
    mgr, _, _ = make(nft, after=0)
    ips = [f"10.244.1.{i}" for i in range(1, 8)]
    await mgr.sync(req(web(*ips), full=True))
    for i in range(2, 8):  # six syncs, each removing one endpoint
        await asyncio.wait_for(mgr.sync(SyncRequest({A: web(ips[0], *ips[i:])},
                                                    removed_endpoints={A: frozenset({ep(ips[i - 1])})})), 1)
    gone = [frozenset({ep(ip)}) for ip in ips[1:]]
    assert nft.installed[A].cluster_endpoints == (ep(ips[0]),) and nft.cleared == []
    await asyncio.sleep(0)
    assert nft.started == [{A: g} for g in gone[:MAX_PASSES]]
    release.set()
    await mgr.stale_cleared()
    assert sorted(nft.cleared, key=str) == sorted([{A: g} for g in gone[:MAX_PASSES]]
                                                  + [{A: gone[4] | gone[5]}], key=str)
    await mgr.close()


async def test_udp_changes_reach_a_reconciler_as_the_whole_rule() -> None:
    """A kernel datapath with DNATed conntrack entries (nftables) gets the rule of every UDP
    ServicePort after a full sync (the first, at start), and of the changed ones after others;
    the frontends of a removed UDP ServicePort count with no endpoint."""
    class Reconciler(FakeKernelDatapath):
        def __init__(self) -> None:
            super().__init__()
            self.rules: list[StaleUdp] = []

        async def reconcile_udp(self, rule: StaleUdp) -> None:
            self.rules.append(rule)

    nft = Reconciler()
    mgr, _, _ = make(nft, after=0)
    dns, other = spn("dns", "dns", "UDP"), spn("other", "dns", "UDP")
    d = state(dns, "10.96.0.10", 53, [ep("10.244.1.5", 53), ep("10.244.1.6", 53)])
    o = state(other, "10.96.0.11", 53, [ep("10.244.1.7", 53)])
    await mgr.sync(req(web("10.244.1.1"), d, o, full=True))
    await mgr.stale_cleared()
    assert nft.cleared == [] and len(nft.rules) == 1
    assert set(nft.rules[0].frontends) == {(packed("10.96.0.10"), 53), (packed("10.96.0.11"), 53)}
    await mgr.sync(SyncRequest({dns: state(dns, "10.96.0.10", 53, [ep("10.244.1.6", 53)])},
                               removed_endpoints={dns: frozenset({ep("10.244.1.5", 53)})}))
    await mgr.stale_cleared()
    assert nft.rules[1].frontends == {(packed("10.96.0.10"), 53): frozenset({(packed("10.244.1.6"), 53)})}
    await mgr.sync(SyncRequest({A: web("10.244.1.2")}))  # TCP only: nothing to reconcile
    await mgr.sync(SyncRequest({other: None}))
    await mgr.stale_cleared()
    assert len(nft.rules) == 3 and nft.rules[2].frontends == {(packed("10.96.0.11"), 53): frozenset()}
    await mgr.close()


async def test_removal_and_stale_endpoints_reach_the_kernel() -> None:
    nft = FakeKernelDatapath()
    mgr, _, _ = make(nft, after=0)
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2"), full=True))
    gone = frozenset({ep("10.244.1.2")})
    await mgr.sync(SyncRequest({A: web("10.244.1.1")}, removed_endpoints={A: gone}))
    await mgr.stale_cleared()
    assert nft.cleared == [{A: gone}]
    await mgr.sync(SyncRequest({A: None}))
    assert nft.installed == {} and mgr.placement(A) is None


async def test_dump_text() -> None:
    nft = FakeKernelDatapath()
    mgr, _, _ = make(nft, after=0)
    b = state(B, "10.96.0.2", 81, [])
    await mgr.sync(SyncRequest({A: web("10.244.1.1", "10.244.1.2"), B: b}, full=True))
    assert mgr.dump() == "\n".join([
        "default/api/TCP nftables (established)",
        "default/web:http/TCP nftables (established)",
        "[nftables]",
        "default/api/TCP 10.96.0.2:81 -> reject",
        "default/web:http/TCP 10.96.0.1:80 -> 10.244.1.1:8080 10.244.1.2:8080",
    ])


async def test_offloads_and_demotions_are_published_as_they_happen() -> None:
    """The web view's events: one per change of datapath, with the reason /services shows."""
    from usproxy.core.events import EventHub

    hub = EventHub()
    sub = hub.subscribe()
    nft = FakeKernelDatapath(unsupported_if=lambda st: "SCTP is served by the relay only"
                             if st.service_port.protocol == "SCTP" else None)
    clock = Clock()
    mgr = OffloadManager(settings(1), [nft], request_sync=lambda: None, clock=clock, events=hub)
    sctp = state(spn("sig", proto="SCTP"), "10.96.0.9", 9, [ep("10.244.1.1")])
    await mgr.sync(SyncRequest({sctp.service_port.name: sctp, A: web("10.244.1.1")}, full=True))
    clock.now += 1
    await mgr.sync(SyncRequest({}))
    nft.fail_next = 1
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2")))  # an update the kernel refuses
    clock.now += 1
    await mgr.sync(SyncRequest({}))  # offloaded again after another window
    await mgr.sync(req(web("10.244.1.1", "10.244.1.2", datapath="userspace")))  # pinned: back to the relay
    got = [(e.kind, e.data["servicePortName"], e.data["datapath"], e.data["reason"]) for e in await sub.next(0)]
    assert got == [
        ("demoted", "default/sig", "userspace", "demoted: nftables: SCTP is served by the relay only"),
        ("offloaded", "default/web:http", "nftables", "established"),
        ("demoted", "default/web:http", "userspace", "demoted: nftables: injected failure (errno 16)"),
        ("offloaded", "default/web:http", "nftables", "established"),
        ("userspace", "default/web:http", "userspace", "pinned by annotation usproxy.io/datapath: userspace"),
    ]


class TcKernel(FakeKernelDatapath):
    """A fake BPF datapath whose tc programs serve external traffic, or not (usproxy.offload.external_route)."""

    def __init__(self, tc: bool) -> None:
        super().__init__("bpf", frozenset({"local", "forwarded"}) if tc else frozenset({"local"}))
        self.tc = tc

    def external_route(self, state: ServicePortState) -> Placement:
        return Placement("tc", "tc on eth0") if self.tc else Placement("relay", "tc programs not asked for")


async def test_external_placement_names_tc_nftables_or_the_relay_with_the_reason() -> None:
    nodeport = web("10.244.1.1", node_port=30080)
    for kernels, want in (((TcKernel(True),), ("tc", "tc on eth0")),
                          ((TcKernel(False), FakeKernelDatapath()),
                           ("nftables", "nftables rules for the NodePort, externalIPs and LoadBalancer IPs")),
                          ((TcKernel(False),), ("relay", "the relay's listeners: tc programs not asked for"))):
        mgr, clock, _ = make(*kernels, after=0.0)
        await mgr.sync(req(nodeport, full=True))
        p = mgr.external_placement(A)
        assert p is not None and (p.datapath, p.reason) == want, [k.name for k in kernels]
    mgr, clock, _ = make(TcKernel(True), after=5.0)
    await mgr.sync(req(nodeport, full=True))  # still in the window: the relay serves everything
    p = mgr.external_placement(A)
    assert p is not None and p.datapath == "relay" and "not offloaded (establishing" in p.reason, p
    await mgr.sync(req(web("10.244.1.1")))  # a ClusterIP only: no external route at all
    assert mgr.external_placement(A) is None


async def test_serves_at_once_only_without_a_window_and_for_every_traffic_kind() -> None:
    """Relay.kernel_serves: a new ServicePort the kernel serves from the sync that brings it
    (--offload-after 0, every traffic kind covered) lets the relay open its listeners after the
    kernel step; a window, a userspace pin, an unsupported feature or a kernel serving local
    traffic only (BPF alone) does not."""
    served = web("10.244.1.1")
    assert make(FakeKernelDatapath(), after=0.0)[0].serves_at_once(served)
    assert not make(FakeKernelDatapath(), after=5.0)[0].serves_at_once(served)
    assert not make(FakeKernelDatapath(), after=0.0)[0].serves_at_once(web("10.244.1.1", datapath="userspace"))
    refused = FakeKernelDatapath(unsupported_if=lambda st: "no")
    assert not make(refused, after=0.0)[0].serves_at_once(served)
    assert not make(FakeKernelDatapath("bpf", frozenset({"local"})), after=0.0)[0].serves_at_once(served)
    assert make(FakeKernelDatapath("bpf", frozenset({"local"})), FakeKernelDatapath(), after=0.0)[0].serves_at_once(served)


async def test_a_datapath_conflicting_with_a_better_usable_one_is_left_out() -> None:
    """The IPVS and iptables datapaths write chains of the same names (their declarations say so):
    where IPVS is usable iptables is left out of the ladder, with the reason; where IPVS is not,
    iptables serves."""
    ipvs, ipt = FakeKernelDatapath("ipvs"), FakeKernelDatapath("iptables")
    mgr, _, _ = make(ipvs, ipt)
    assert [k.name for k in mgr.usable_kernels()] == ["ipvs"]
    assert not mgr.capabilities["iptables"].available
    assert "ipvs serves here" in mgr.capabilities["iptables"].detail
    mgr2, _, _ = make(FakeKernelDatapath("ipvs", available=False), FakeKernelDatapath("iptables"))
    assert [k.name for k in mgr2.usable_kernels()] == ["iptables"]


class SlowProbe(FakeKernelDatapath):
    """A probe that takes a while (the BPF object's load, iptables' restore in a netns): it
    says when it started and then waits for `go` (at most 5 s)."""

    def __init__(self, name: str, traffic: frozenset[TrafficKind], *, available: bool) -> None:
        super().__init__(name, traffic, available=available)
        self.started, self.go = threading.Event(), threading.Event()

    def probe(self) -> Capability:
        self.started.set()
        self.go.wait(5)
        return super().probe()


async def test_flows_view_in_a_worker_during_the_first_probe_leaves_the_ladder_whole() -> None:
    """/flows runs flows_view in a worker thread; when it came before the first sync had
    probed, the sync read a ladder still being probed and left every ServicePort in the relay
    ("demoted: bpf unavailable") beside a usable nftables (the VM lab's cgroup1, once)."""
    bpf = SlowProbe("bpf", frozenset({"local"}), available=False)
    nft = FakeKernelDatapath()
    mgr, _, _ = make(bpf, nft, after=0.0)
    viewer = threading.Thread(target=mgr.flows_view)
    viewer.start()
    bpf.started.wait(1)  # the viewer is probing, if it probes at all
    threading.Timer(0.3, bpf.go.set).start()
    await mgr.sync(req(web("10.244.1.1"), full=True))
    viewer.join(5)
    p = mgr.placement(A)
    assert p is not None and p.datapath == "nftables", p
    assert set(nft.installed) == {A}


async def test_usable_kernels_from_two_threads_both_get_the_whole_ladder() -> None:
    bpf = SlowProbe("bpf", frozenset({"local"}), available=False)
    nft = FakeKernelDatapath()
    mgr, _, _ = make(bpf, nft)
    seen: list[list[str]] = []
    first = threading.Thread(target=lambda: seen.append([k.name for k in mgr.usable_kernels()]))
    first.start()
    assert bpf.started.wait(5)
    threading.Timer(0.3, bpf.go.set).start()
    second = await asyncio.to_thread(lambda: [k.name for k in mgr.usable_kernels()])
    first.join(5)
    assert seen == [["nftables"]] and second == ["nftables"]
    assert set(mgr.capabilities) == {"bpf", "nftables"}
