"""PodSource: where the source of `explain trace` runs, as far as the input says.

A learner's first trace starts from a pod they know from the manifests (a demo pod such as
10.244.1.10), not from a pod CIDR they would have to pass with --cluster-cidr. The input says
where a pod runs in two ways, read here in this order:

- an EndpointSlice endpoint with that address and a `nodeName`: a pod (or a host-network
  process) on that node;
- a Node object whose spec.podCIDRs (spec.podCIDR) holds the address: a pod on that Node, as
  detectLocalMode NodeCIDR reads them.

`locate` returns the node and the reason in words, or None when the input says nothing; what the
trace then does with it (render for that node, trace the source as a process in the BPF cgroup)
is explain/cli.py's. Invariant: a pure function of its input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from usproxy.model.service_set import ServiceSet
from usproxy.model.node import NodePodCIDRs
from usproxy.model.types import IPAddress


@dataclass(frozen=True, slots=True)
class PodSource:
    """A source address the input places on `node`: `what` it is there, and `how` the input
    says so, in words."""

    node: str
    what: str
    how: str

    @property
    def why(self) -> str:
        return f"{self.what} on node {self.node} ({self.how})"


def locate(src: IPAddress, ss: ServiceSet, nodes: Mapping[str, NodePodCIDRs]) -> PodSource | None:
    """The node the input places `src` on: an endpoint's nodeName first, else the Node whose
    podCIDRs hold it; None when neither says (or endpoints of `src` name different nodes)."""
    places: dict[str, list[str]] = {}
    for sp, eps in ss.ports:
        for ep in eps:
            if ep.ip == src and ep.node_name:
                services = places.setdefault(ep.node_name, [])
                if str(sp.name.service) not in services:
                    services.append(str(sp.name.service))
    if len(places) == 1:
        ((node, services),) = places.items()
        return PodSource(node, f"an endpoint of {', '.join(services)}", "its EndpointSlice's nodeName")
    if places:
        return None  # the input contradicts itself: say nothing rather than pick a node
    for obj in sorted(nodes.values(), key=lambda n: n.name):
        cidr = next((c for c in obj.pod_cidrs if src in c), None)
        if cidr is not None:
            return PodSource(obj.name, "a pod", f"inside Node {obj.name}'s podCIDR {cidr}")
    return None
