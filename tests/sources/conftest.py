"""Fixtures for the Kubernetes source tests: a running fake API server, fast reflector timings,
a recording Provider, object builders, and `eventually()` for convergence checks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text
from usproxy.model.endpoint_slice import EndpointSlice, parse_endpoint_slice
from usproxy.model.service import Service, parse_service, skip_reason
from usproxy.sources.kube import slice_skip_reason
from usproxy.sources.reflector import ReflectorOptions
from usproxy.model.types import NamespacedName

# Everything short, so each fault resolves in well under a second.
FAST = ReflectorOptions(min_watch_timeout=1.0, read_timeout=0.5, list_timeout=0.5, backoff_initial=0.05,
                        backoff_max=0.2, backoff_jitter=0.0, short_watch=0.05, page_size=500)


async def eventually(cond: Callable[[], object], timeout: float = 3.0, what: str = "condition") -> None:
    """Wait until `cond()` is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def svc(name: str, ip: str, port: int = 80, ns: str = "default", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, **meta},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}


def eps(name: str, service: str, ips: list[str], port: int = 8080, ns: str = "default",
        node: str = "node-a", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns,
                         "labels": {"kubernetes.io/service-name": service, **(labels or {})}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": node} for ip in ips],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}


def node(name: str, zone: str | None = None) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, **({"topology.kubernetes.io/zone": zone} if zone else {})}
    return {"metadata": {"name": name, "labels": labels}}


class Recorder:
    """A Provider that records every call and keeps the state it was told about."""

    def __init__(self) -> None:
        self.zone: str | None = None
        self.services: dict[NamespacedName, Service] = {}
        self.slices: dict[NamespacedName, EndpointSlice] = {}
        self.calls: list[tuple[str, Any, Any]] = []  # (kind, previous, current)
        self.synced: list[str] = []
        self.order: list[str] = []

    def set_zone(self, zone: str | None) -> None:
        self.zone = zone

    def on_service_update(self, previous: Service | None, current: Service | None) -> None:
        self.calls.append(("service", previous, current))
        self.order.append("service")
        assert (previous is None) == ((previous or current).name not in self.services)  # type: ignore[union-attr]
        if current is None:
            del self.services[previous.name]  # type: ignore[union-attr]
        else:
            self.services[current.name] = current

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None:
        self.calls.append(("slice", previous, current))
        self.order.append("slice")
        assert (previous is None) == ((previous or current).name not in self.slices)  # type: ignore[union-attr]
        if current is None:
            del self.slices[previous.name]  # type: ignore[union-attr]
        else:
            self.slices[current.name] = current

    def on_services_synced(self) -> None:
        self.synced.append("services")
        self.order.append("synced:services")

    def on_endpoint_slices_synced(self) -> None:
        self.synced.append("endpointslices")
        self.order.append("synced:endpointslices")

    def deletes(self) -> int:
        return sum(1 for _, _, cur in self.calls if cur is None)


def service_yaml(name: str, port: int) -> str:
    """A Service manifest (YAML text) with one port, for the static source's files."""
    return (f"apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\n"
            f"spec: {{clusterIP: 10.96.0.{port % 250 + 1}, ports: [{{port: {port}}}]}}\n")


def server_state(api: FakeApiServer) -> tuple[dict[NamespacedName, Service], dict[NamespacedName, EndpointSlice]]:
    """What a correct source must hold: the server's objects, filtered and parsed the same way."""
    services = {}
    for raw in api.objects["services"].values():
        if skip_reason(raw) is None:
            s = parse_service(raw)
            services[s.name] = s
    slices = {}
    for raw in api.objects["endpointslices"].values():
        if slice_skip_reason(raw) is None:
            e = parse_endpoint_slice(raw)
            slices[e.name] = e
    return services, slices


def converged(api: FakeApiServer, rec: Recorder) -> bool:
    return server_state(api) == (rec.services, rec.slices)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval=0.2)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(api: FakeApiServer, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig_text(api.url, api.token))
    return path
