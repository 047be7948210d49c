"""KubeSource against the fake API server: the Provider contract, invalid objects, filtering,
node awareness, credentials, and the API server going away (model level: Proxier + FakeDatapath).
"""

from __future__ import annotations

import asyncio
import logging
from ipaddress import ip_network
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.sources.conftest import FAST, Recorder, converged, eventually, eps, node, server_state, svc
from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text
from usproxy.admin.health import evaluate
from usproxy.util.metrics import Metrics
from usproxy.model.config import ProxyConfig
from usproxy.core.datapath import FakeDatapath
from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.util.errors import ConfigError
from usproxy.model.node import NodeFacts
from usproxy.core.proxier import Proxier
from usproxy.model.service import Service
from usproxy.sources.kube import KubeSource, NodeAwareProvider
from usproxy.model.types import IPNetwork, NamespacedName

A = NamespacedName("default", "a")


class Source:
    """A KubeSource running as a task."""

    def __init__(self, kubeconfig: Path, provider: NodeAwareProvider, metrics: Metrics | None = None,
                 node_name: str = "node-a") -> None:
        cfg = ProxyConfig(kubeconfig=kubeconfig)
        self.source = KubeSource(cfg, provider, metrics, node_name=node_name, options=FAST, node_wait=1.0)
        self.task = asyncio.create_task(self.source.run())

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def source(kubeconfig: Path, rec: Recorder, metrics: Metrics) -> AsyncIterator[Source]:
    s = Source(kubeconfig, rec, metrics)
    try:
        yield s
    finally:
        await s.stop()


def errors(metrics: Metrics, kind: str) -> float:
    return float(metrics.config_errors.labels(kind)._value.get())


async def relist(api: FakeApiServer, objs: list[dict[str, object]]) -> None:
    """Change the Services with no events and force a relist (compaction, then a new watch)."""
    api.replace_all("services", objs)
    api.end_streams()


# -- the Provider contract ---------------------------------------------------------------------

async def test_first_list_delivers_then_synced_once(api: FakeApiServer, kubeconfig: Path, rec: Recorder) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("endpointslices", eps("a-1", "a", ["10.0.0.1", "10.0.0.2"]))
    api.faults.html_error = 2
    api.faults.only = {"services"}
    s = Source(kubeconfig, rec)
    try:
        await eventually(lambda: "endpointslices" in rec.synced, what="slices synced")
        assert "services" not in rec.synced  # its list is still failing
        await eventually(lambda: "services" in rec.synced, what="services synced")
        assert converged(api, rec)
        assert rec.order.index("service") < rec.order.index("synced:services")  # objects first, then synced
        await relist(api, [svc("a", "10.96.0.1")])
        await eventually(lambda: s.source.reflectors["services"].lists >= 2)
        assert sorted(rec.synced) == ["endpointslices", "services"]  # once each, relists do not repeat it
    finally:
        await s.stop()


async def test_follows_adds_updates_and_deletes(api: FakeApiServer, source: Source, rec: Recorder) -> None:
    await eventually(lambda: len(rec.synced) == 2)
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("endpointslices", eps("a-1", "a", ["10.0.0.1"]))
    await eventually(lambda: converged(api, rec))
    api.apply("services", svc("a", "10.96.0.1", port=8080))
    api.apply("endpointslices", eps("a-1", "a", ["10.0.0.1", "10.0.0.3"]))
    await eventually(lambda: converged(api, rec))
    api.delete("endpointslices", "a-1")
    api.delete("services", "a")
    await eventually(lambda: not rec.services and not rec.slices)


async def test_relist_delivers_deletes_and_only_real_changes(api: FakeApiServer, source: Source,
                                                             rec: Recorder) -> None:
    for name, ip in (("a", "10.96.0.1"), ("b", "10.96.0.2"), ("c", "10.96.0.3")):
        api.apply("services", svc(name, ip))
    await eventually(lambda: converged(api, rec))
    before = len(rec.calls)
    await relist(api, [svc("a", "10.96.0.1"), svc("b", "10.96.0.2", port=81), svc("d", "10.96.0.4")])
    await eventually(lambda: converged(api, rec), what="converged after relist")
    after = [(_name(prev), _name(cur)) for _, prev, cur in rec.calls[before:]]
    assert sorted(after, key=str) == sorted([("c", None), ("b", "b"), (None, "d")], key=str)


def _name(obj: object) -> str | None:
    return obj.name.name if isinstance(obj, Service) else None


# -- invalid objects ---------------------------------------------------------------------------

async def test_invalid_update_keeps_previous_version(api: FakeApiServer, source: Source, rec: Recorder,
                                                     metrics: Metrics, caplog: pytest.LogCaptureFixture) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("services", svc("b", "10.96.0.2"))
    await eventually(lambda: converged(api, rec))
    good = rec.services[A]
    api.apply("services", svc("a", "not-an-ip"))
    api.apply("services", svc("b", "10.96.0.2", port=443))  # the others keep flowing
    await eventually(lambda: rec.services[NamespacedName("default", "b")].ports != {} and
                     next(iter(rec.services[NamespacedName("default", "b")].ports.values())).port == 443)
    assert rec.services[A] is good
    assert errors(metrics, "Service") == 1
    assert "Service default/a: spec.clusterIPs[0]: not a valid IP address: 'not-an-ip'" in caplog.text
    assert "keeping its previous version" in caplog.text
    # A relist that still sees the bad version keeps the good one too: no delete.
    await relist(api, list(api.objects["services"].values()))
    await eventually(lambda: source.source.reflectors["services"].lists >= 2)
    assert rec.services[A] is good and rec.deletes() == 0
    api.apply("services", svc("a", "10.96.0.11"))  # fixed
    await eventually(lambda: str(next(iter(rec.services[A].ports.values())).cluster_ip) == "10.96.0.11")


async def test_invalid_new_objects_are_skipped_and_counted(api: FakeApiServer, source: Source, rec: Recorder,
                                                           metrics: Metrics, caplog: pytest.LogCaptureFixture) -> None:
    bad_slice = eps("x-1", "x", ["10.0.0.1"])
    bad_slice["endpoints"][0]["conditions"]["ready"] = "yes"
    api.apply("endpointslices", bad_slice)
    api.apply("services", {"metadata": {"name": "noports"}, "spec": {"clusterIP": "10.96.0.5"}})
    api.apply("services", svc("fine", "10.96.0.6"))
    await eventually(lambda: NamespacedName("default", "fine") in rec.services)
    await eventually(lambda: errors(metrics, "EndpointSlice") == 1)
    assert errors(metrics, "Service") == 1 and not rec.slices
    assert "EndpointSlice default/x-1: endpoints[0].conditions.ready: must be true or false" in caplog.text
    assert "Service default/noports: spec.ports: at least one port is required" in caplog.text


# -- filtering ---------------------------------------------------------------------------------

async def test_filtering_as_kube_proxy(api: FakeApiServer, source: Source, rec: Recorder) -> None:
    other = {"service.kubernetes.io/service-proxy-name": "other-proxy"}
    mine = {"service.kubernetes.io/service-proxy-name": "usproxy"}
    api.apply("services", svc("plain", "10.96.0.1"))
    api.apply("services", svc("mine", "10.96.0.2", labels=mine))
    api.apply("services", svc("theirs", "10.96.0.3", labels=other))
    api.apply("services", {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})
    api.apply("services", {"metadata": {"name": "ext"}, "spec": {"type": "ExternalName", "externalName": "x.example"}})
    api.apply("endpointslices", eps("headless-1", "headless", ["10.0.0.9"], labels={"service.kubernetes.io/headless": ""}))
    api.apply("endpointslices", eps("theirs-1", "theirs", ["10.0.0.8"], labels=other))
    api.apply("endpointslices", eps("plain-1", "plain", ["10.0.0.7"]))
    await eventually(lambda: converged(api, rec) and len(rec.services) == 2)
    assert {n.name for n in rec.services} == {"plain", "mine"}
    assert {n.name for n in rec.slices} == {"plain-1"}
    eps_lists = [q for r, q in api.requests if r == "endpointslices"]
    assert all(q["labelSelector"] == "!service.kubernetes.io/headless" for q in eps_lists)
    api.apply("services", svc("plain", "10.96.0.1", labels=other))  # handed to another proxy: it leaves us
    await eventually(lambda: NamespacedName("default", "plain") not in rec.services)
    api.apply("services", svc("plain", "10.96.0.1"))  # and comes back
    await eventually(lambda: NamespacedName("default", "plain") in rec.services)


# -- node awareness ----------------------------------------------------------------------------

class ZoneAtSync(Recorder):
    """Remembers which zone was known when the Services were first synced."""

    zone_at_sync: str | None = "unset"

    def on_services_synced(self) -> None:
        self.zone_at_sync = self.zone
        super().on_services_synced()


async def test_zone_comes_from_this_nodes_labels(api: FakeApiServer, kubeconfig: Path) -> None:
    api.apply("nodes", node("node-a", zone="zone-1"))
    api.apply("nodes", node("node-b", zone="zone-2"))
    rec = ZoneAtSync()
    s = Source(kubeconfig, rec)
    try:
        await eventually(lambda: "services" in rec.synced)
        assert rec.zone_at_sync == "zone-1"  # known before the first sync
        assert [q["fieldSelector"] for r, q in api.requests if r == "nodes"][0] == "metadata.name=node-a"
        api.apply("nodes", node("node-a", zone="zone-3"))
        await eventually(lambda: rec.zone == "zone-3", what="zone change followed")
    finally:
        await s.stop()


async def test_node_being_deleted_is_not_eligible(api: FakeApiServer, source: Source) -> None:
    api.apply("nodes", node("node-a"))
    await eventually(lambda: source.source.reflectors.get("node") and source.source.reflectors["node"].synced.is_set())
    assert source.source.node_eligible
    tainted = node("node-a")
    tainted["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
    api.apply("nodes", tainted)
    await eventually(lambda: not source.source.node_eligible, what="taint seen")
    api.apply("nodes", node("node-a"))
    await eventually(lambda: source.source.node_eligible, what="taint removed")
    api.apply("nodes", {**node("node-a"), "metadata": {**node("node-a")["metadata"],
                                                       "deletionTimestamp": "2026-01-01T00:00:00Z"}})
    await eventually(lambda: not source.source.node_eligible, what="deletionTimestamp seen")
    api.apply("nodes", node("node-a"))
    await eventually(lambda: source.source.node_eligible)
    api.delete("nodes", "node-a")
    await eventually(lambda: not source.source.node_eligible, what="Node deleted")


async def test_node_access_forbidden_is_tolerated(api: FakeApiServer, kubeconfig: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    api.faults.forbidden = {"nodes"}
    api.apply("services", svc("a", "10.96.0.1"))
    rec = Recorder()
    s = Source(kubeconfig, rec)
    try:
        await eventually(lambda: converged(api, rec) and len(rec.synced) == 2)
        await asyncio.sleep(0.3)  # several retries
        assert rec.zone is None
        assert caplog.text.count("nodes is forbidden") >= 1
        assert [r.levelno for r in caplog.records if "forbidden" in r.message].count(logging.WARNING) == 1
    finally:
        await s.stop()


# -- ServiceCIDRs --------------------------------------------------------------------------------

class CidrDatapath(FakeDatapath):
    """A FakeDatapath that also takes the Service CIDRs (as the nftables datapath does)."""

    def __init__(self) -> None:
        super().__init__()
        self.cidrs: tuple[IPNetwork, ...] = ()

    def on_service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        self.cidrs = cidrs


def service_cidr(name: str, *cidrs: str) -> dict[str, object]:
    return {"metadata": {"name": name}, "spec": {"cidrs": list(cidrs)}}


async def test_service_cidr_objects_reach_the_datapath(api: FakeApiServer, kubeconfig: Path) -> None:
    api.apply("servicecidrs", service_cidr("kubernetes", "10.96.0.0/16"))
    dp = CidrDatapath()
    proxier = Proxier([dp], node=NodeFacts("node-a"))
    s = Source(kubeconfig, proxier)
    try:
        await eventually(lambda: dp.cidrs == (ip_network("10.96.0.0/16"),), what="the listed ServiceCIDR")
        api.apply("servicecidrs", service_cidr("extra", "10.100.0.0/16", "fd00:100::/112"))
        await eventually(lambda: dp.cidrs == (ip_network("10.96.0.0/16"), ip_network("10.100.0.0/16"),
                                              ip_network("fd00:100::/112")), what="the added ServiceCIDR")
        api.delete("servicecidrs", "kubernetes")
        await eventually(lambda: dp.cidrs == (ip_network("10.100.0.0/16"), ip_network("fd00:100::/112")),
                         what="the deleted ServiceCIDR")
    finally:
        await s.stop()


async def test_service_cidrs_not_served_is_logged_once(api: FakeApiServer, kubeconfig: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "usproxy.sources.kube")
    api.faults.missing = {"servicecidrs"}
    api.apply("services", svc("a", "10.96.0.1"))
    rec = Recorder()
    s = Source(kubeconfig, rec)
    try:
        await eventually(lambda: converged(api, rec) and len(rec.synced) == 2)
        await asyncio.sleep(0.5)  # FAST backs off 0.05-0.2 s: a retry would have come by now
        asked = [q for r, q in api.requests if r == "servicecidrs"]
        assert len(asked) == 1, asked
        assert caplog.text.count("ServiceCIDRs: not served by the API server (404)") == 1
    finally:
        await s.stop()


# -- configuration and credentials -------------------------------------------------------------

def test_bad_kubeconfigs_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    with pytest.raises(ConfigError, match=r"kubeconfig .*missing: no such file"):
        KubeSource(ProxyConfig(kubeconfig=tmp_path / "missing"), rec, node_name="node-a")
    (tmp_path / "broken").write_text("clusters: [\n")
    with pytest.raises(ConfigError, match=r"kubeconfig .*broken: cannot use"):
        KubeSource(ProxyConfig(kubeconfig=tmp_path / "broken"), rec, node_name="node-a")
    (tmp_path / "nocontext").write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    with pytest.raises(ConfigError, match=r"kubeconfig .*nocontext: cannot use"):
        KubeSource(ProxyConfig(kubeconfig=tmp_path / "nocontext"), rec, node_name="node-a")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="in-cluster configuration"):
        KubeSource(ProxyConfig(), rec, node_name="node-a")


async def test_bearer_token_from_kubeconfig(tmp_path: Path) -> None:
    api = FakeApiServer(token="s3cret")
    await api.start()
    api.apply("services", svc("a", "10.96.0.1"))
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(kubeconfig_text(api.url, "s3cret"))
    bad.write_text(kubeconfig_text(api.url, "wrong"))
    rec_bad, rec_good = Recorder(), Recorder()
    sources = [Source(bad, rec_bad), Source(good, rec_good)]
    try:
        await eventually(lambda: converged(api, rec_good))
        assert rec_bad.synced == [] and not rec_bad.services
    finally:
        for s in sources:
            await s.stop()
        await api.stop()


# -- the API server goes away (model level) ----------------------------------------------------

async def test_api_server_down_keeps_serving_the_last_known_state(api: FakeApiServer, kubeconfig: Path) -> None:
    dp = FakeDatapath("userspace")
    proxier = Proxier([dp], node=NodeFacts("node-a"), min_sync_period=0.01, sync_period=30)
    runner = asyncio.create_task(proxier.runner.loop())
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("endpointslices", eps("a-1", "a", ["10.0.0.1", "10.0.0.2"]))
    api.apply("services", svc("b", "10.96.0.2"))
    api.apply("endpointslices", eps("b-1", "b", ["10.0.0.3"]))
    s = Source(kubeconfig, proxier)
    try:
        await eventually(lambda: dp.dump().count("->") == 2 and "<none>" not in dp.dump(), what="first sync")
        services, dump, syncs = dict(proxier.service_map), dp.dump(), len(dp.syncs)
        await api.stop()
        await asyncio.sleep(1.0)  # FAST backoff: 0.05, 0.1, 0.2, 0.2 ... several rounds per reflector
        assert s.source.reflectors["services"].backoff._next == FAST.backoff_max
        assert dict(proxier.service_map) == services and dp.dump() == dump
        assert len(dp.syncs) == syncs  # nothing was synced away
        assert evaluate(proxier.last_updated, proxier.oldest_queued, 60).healthy
        api.delete("services", "b")  # changed while down; the restart loses the history
        api.apply("endpointslices", eps("a-1", "a", ["10.0.0.1", "10.0.0.9"]))
        await api.restart()
        await eventually(lambda: "10.0.0.9" in dp.dump() and "default/b" not in dp.dump(), what="converged")
        assert set(proxier.service_map) == {sp for sp in proxier.service_map if sp.name == "a"}
        assert server_state(api)[0].keys() == {A}
    finally:
        await s.stop()
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


class HoldingRecorder(Recorder):
    """A Recorder that can hold its syncs (as the Proxier) and notes every call made unheld."""

    def __init__(self) -> None:
        super().__init__()
        self.holds = 0
        self.unheld: list[str] = []

    @contextmanager
    def hold_syncs(self) -> Iterator[None]:
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None:
        if not self.holds:
            self.unheld.append("slice")
        super().on_endpoint_slice_update(previous, current)

    def on_endpoint_slices_synced(self) -> None:
        if not self.holds:
            self.unheld.append("synced")
        super().on_endpoint_slices_synced()


async def test_a_relist_is_delivered_whole_with_syncs_held(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig_text("https://127.0.0.1:1", "token"))
    rec = HoldingRecorder()
    cache = KubeSource(ProxyConfig(kubeconfig=path), rec, node_name="node-a").slices
    await cache.replace([eps("web-1", "web", ["10.244.1.1"]), eps("old", "web", ["10.244.2.2"]),
                         {"metadata": {"name": "bad", "labels": {"kubernetes.io/service-name": "web"}},
                          "endpoints": [{"addresses": ["10.244.9.9"]}] * 1001}])
    await cache.replace([eps("web-1", "web", ["10.244.1.1", "10.244.3.3"]), eps("new", "web", ["10.244.2.2"])])
    assert rec.unheld == [] and rec.holds == 0
    assert rec.order == ["slice", "slice", "synced:endpointslices", "slice", "slice", "slice"]
    deleted, changed, added = rec.calls[2:]
    assert (deleted[1].name.name, deleted[2]) == ("old", None)  # deletes first, then list order
    assert changed[2].name.name == "web-1" and added[2].name.name == "new"
    assert set(rec.slices) == {NamespacedName("default", "web-1"), NamespacedName("default", "new")}
