"""Which datapath serves a ServicePort's traffic from outside the node, and why.

External traffic: packets from another host to a NodePort, an externalIP or a LoadBalancer IP.
The first kernel datapath holding the ServicePort that serves it says so: the BPF datapath when its
tc programs run ("tc", BpfDatapath.external_route), nftables through its external chains; when
none does, the relay's listeners serve it and the reason says why no kernel datapath does (tc not
asked for or unavailable, the ServicePort not offloaded, an IPv6-only frontend). Shown per
ServicePort in /services ("external", "externalReason") and `usproxy status` (EXTERNAL column).
A ServicePort without external frontends has no external route (None).
"""

from __future__ import annotations

from collections.abc import Sequence

from usproxy.core.datapath import ExternalServing, Placement, ServicePortState
from usproxy.offload.kernel_datapath import KernelDatapath
from usproxy.model.service_port import ServicePort

RELAY = "relay"


def has_external(sp: ServicePort) -> bool:
    """Whether `sp` has a frontend for traffic from outside the node."""
    return bool(sp.node_port or sp.external_ips or sp.load_balancer_ips)


def route(state: ServicePortState, placed: Sequence[KernelDatapath], why_not: str = "") -> Placement | None:
    """The external route of `state` held by the kernel datapaths `placed` (in the manager's
    order); `why_not` is the relay's reason when nothing placed says one (e.g. not offloaded)."""
    if not has_external(state.service_port):
        return None
    reasons: list[str] = []
    for k in placed:
        if isinstance(k, ExternalServing):
            here = k.external_route(state)
            if here.datapath != RELAY:
                return here
            reasons.append(here.reason)
        elif "forwarded" in k.traffic:
            return Placement(k.name, f"{k.name} rules for the NodePort, externalIPs and LoadBalancer IPs")
    reasons.append(why_not or "no kernel datapath holds this ServicePort")
    return Placement(RELAY, "the relay's listeners: " + reasons[0])
