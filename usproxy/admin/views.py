"""The /services and /flows rows and the web view's ServicePortStates, read from the Proxier and
the datapaths (the agent hands them over; nothing here changes state).

Rows are built in chunks of about VIEW_CHUNK items with the loop running in between, so a view of
100,000 endpoints or 10,000 flows does not stall the relay. Whether an endpoint is usable is a set
lookup (a tuple scan made 10,000 endpoints cost 8.8 s on the loop). Each row is one ServicePort's
state when its turn came; the lists and rows are new, held by nothing else (usproxy.admin.snapshot
encodes and frees them in a worker thread). Kernel flows are listed in a worker thread: dumping
kernel conntrack takes ~0.3 s per 1,000 entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from usproxy.core.datapath import ChunkedFlowsView, Datapath, ExternalView, FlowsView, Placement, ServicePortState
from usproxy.core.proxier import Proxier
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import NamespacedName, ServicePortName
from usproxy.offload import external_route
from usproxy.util.rows import EndpointRow, FlowRow, ServiceRow

VIEW_CHUNK = 250  # rows of /services and /flows built between two turns of the loop (~1-2 ms)
SERVICE_ROW_WORK = 4  # a ServicePort's own row costs about as much as 4 endpoint rows


class HealthErrors(Protocol):
    """Where a Service's health-check port error is read (the ServiceHealthServer)."""

    def error_of(self, name: NamespacedName) -> str | None: ...


class AgentViews:
    """The rows of one agent's views. `bpf_lb_mode`: --bpf-lb-mode when BPF's tc programs may
    serve external traffic (--offload bpf), else None."""

    def __init__(self, proxier: Proxier, datapaths: Sequence[Datapath], health_errors: HealthErrors,
                 bpf_lb_mode: str | None) -> None:
        self.proxier = proxier
        self.datapaths = datapaths
        self.health_errors = health_errors
        self.bpf_lb_mode = bpf_lb_mode

    async def services(self, chunk: int = VIEW_CHUNK) -> list[ServiceRow]:
        """/services: one row per ServicePort, sorted by name, `chunk` items at a time."""
        out: list[ServiceRow] = []
        work = 0
        external = self._external_view()
        for spn in sorted(self.proxier.service_map):
            st = self.proxier.state_of(spn)
            if st is None:
                continue
            usable = set(st.cluster_endpoints)
            eps: list[EndpointRow] = []
            for ep in st.endpoints:
                eps.append(_endpoint_row(ep, usable))
                work += 1
                if work >= chunk:
                    work = 0
                    await asyncio.sleep(0)
            out.append(self._service_row(spn, st, eps, external))
            work += SERVICE_ROW_WORK
        return out

    def _service_row(self, spn: ServicePortName, st: ServicePortState,
                     endpoints: list[EndpointRow], external: ExternalView | None) -> ServiceRow:
        sp = st.service_port
        where = self.proxier.placement(spn)
        ext = self._external(spn, st, external)
        return {
            "servicePortName": str(spn), "protocol": sp.protocol,
            "clusterIPs": [str(ip) for ip in sp.cluster_ips], "port": sp.port,
            "nodePort": sp.node_port, "type": sp.service_type,
            "externalIPs": [str(ip) for ip in sp.external_ips_all()],
            "sessionAffinity": sp.session_affinity, "affinityTimeoutSeconds": sp.affinity_timeout,
            "externalTrafficPolicy": sp.external_traffic_policy,
            "internalTrafficPolicy": sp.internal_traffic_policy,
            "endpoints": endpoints,
            "datapath": where.datapath, "reason": where.reason,
            "bpfLbMode": bpf_lb_mode(self.bpf_lb_mode, ext),
            "external": ext.datapath if ext else None, "externalReason": ext.reason if ext else "",
            "healthCheckNodePort": sp.health_check_node_port,
            "healthCheckError": self.health_errors.error_of(spn.service),
        }

    def _external_view(self) -> ExternalView | None:
        """The datapath that tells external placements, looked up once per view: a runtime
        Protocol check per row was a fifth of /services' cost."""
        return next((dp for dp in self.datapaths if isinstance(dp, ExternalView)), None)

    def _external(self, spn: ServicePortName, st: ServicePortState, view: ExternalView | None) -> Placement | None:
        """Which datapath serves `spn` from outside the node (usproxy.offload.external_route)."""
        if view is not None:
            return view.external_placement(spn)
        return external_route.route(st, (), "no kernel datapath configured (--offload none)")

    def service_ports(self, service: NamespacedName | None = None) -> list[ServicePortState]:
        """Every ServicePort (of `service` only, when given) with its endpoints now, sorted by name
        (the web view's drawings). The state of each is computed, so names are filtered first:
        one Service's drawing never costs a pass over 5,000 Services' endpoints."""
        names = sorted(spn for spn in self.proxier.service_map
                       if service is None or (spn.namespace, spn.name) == service)
        states = (self.proxier.state_of(spn) for spn in names)
        return [st for st in states if st is not None]

    async def flows(self) -> list[FlowRow]:
        """/flows: the relay's rows (read on the loop, where its flow table lives, VIEW_CHUNK at a
        time: 9,800 flows cost 0.15 s in one piece), then the kernel datapaths' rows, read in a
        worker thread."""
        out: list[FlowRow] = []
        for dp in self.datapaths:
            if isinstance(dp, ChunkedFlowsView):
                for chunk in dp.flows_chunks(VIEW_CHUNK):
                    out.extend(chunk)
                    await asyncio.sleep(0)
            elif not isinstance(dp, FlowsView):
                continue
            elif dp.flows_block:
                out.extend(await asyncio.to_thread(dp.flows_view))
            else:
                out.extend(dp.flows_view())
        return out


def bpf_lb_mode(mode: str | None, external: Placement | None) -> str | None:
    """/services' bpfLbMode: --bpf-lb-mode ("snat" or "dsr", usproxy/offload/bpf/dsr.h; `mode`,
    None unless --offload bpf) for a ServicePort whose traffic from outside the node the tc
    programs serve (its NodePort, externalIPs and LoadBalancer IPs alike, as Cilium's
    bpf-lb-mode), else None."""
    return mode if external is not None and external.datapath == "tc" else None


def _endpoint_row(ep: Endpoint, usable: set[Endpoint]) -> EndpointRow:
    return {"address": str(ep), "ready": ep.ready, "serving": ep.serving, "terminating": ep.terminating,
            "nodeName": ep.node_name, "usable": ep in usable}
