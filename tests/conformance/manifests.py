"""Scenarios rendered as the static manifests and KubeProxyConfiguration an agent reads.

`objects(group, phase)` gives every Service and EndpointSlice of the group's scenarios, with
addresses and ports mapped (tests/conformance/addresses.py) by each scenario's index in its group;
in phase 1 a scenario's `after` change is applied (its slices or its Services left out).
The Service CIDR goes in as a networking.k8s.io/v1 ServiceCIDR object, which the agent reads as
kube-proxy does (no --service-cidr is given). `kube_proxy_configuration(group)` gives the agent's
config as kube-proxy's fake proxier has it.
"""

from __future__ import annotations

from typing import Any

from tests.conformance import addresses as A
from tests.conformance.reference import NODE, Group, Scenario, Slice, Svc

SERVICE_CIDR = "172.30.0.0/16"  # NewFakeProxier's serviceCIDRs
POD_CIDR = "10.244.0.0/16"  # kube-proxy's fake: 10.0.0.0/8 (its pods); here every pod is in 10.244/16
NO_POD_CIDR = "10.99.0.0/16"  # a clusterCIDR holding no pod: detectLocalMode NodeCIDR must not use it


def scenario_index(group: Group, scenario: Scenario) -> int:
    return group.scenarios.index(scenario) + 1


def _service(s: Svc, k: int) -> dict[str, Any]:
    ports = []
    for p in s.ports:
        port: dict[str, Any] = {"name": p.name, "port": p.port, "protocol": p.protocol,
                                "targetPort": p.target_port if p.target_port is not None else p.port}
        if p.node_port:
            port["nodePort"] = A.node_port(p.node_port, k)
        ports.append(port)
    spec: dict[str, Any] = {"type": s.type, "clusterIP": A.addr(s.cluster_ip, k), "ports": ports,
                            "internalTrafficPolicy": s.itp}
    if s.type != "ClusterIP":
        spec["externalTrafficPolicy"] = s.etp
    if s.external_ips:
        spec["externalIPs"] = [A.addr(ip, k) for ip in s.external_ips]
    if s.source_ranges:
        spec["loadBalancerSourceRanges"] = [A.cidr(c) for c in s.source_ranges]
    if s.hc_node_port:
        spec["healthCheckNodePort"] = A.node_port(s.hc_node_port, k)
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Service",
                            "metadata": {"name": s.name, "namespace": _ns(s.namespace, k)}, "spec": spec}
    if s.lb_ips:
        body["status"] = {"loadBalancer": {"ingress": [{"ip": A.addr(ip, k)} for ip in s.lb_ips]}}
    return body


def _slice(sl: Slice, k: int) -> dict[str, Any]:
    eps = []
    for e in sl.endpoints:
        cond = {name: v for name, v in (("ready", e.ready), ("serving", e.serving),
                                        ("terminating", e.terminating)) if v is not None}
        item: dict[str, Any] = {"addresses": [A.addr(e.ip, k)], "conditions": cond}
        if e.node is not None:
            item["nodeName"] = e.node
        eps.append(item)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{sl.service}-1", "namespace": _ns(sl.namespace, k),
                         "labels": {"kubernetes.io/service-name": sl.service}},
            "ports": [{"name": p.name, "port": p.port, "protocol": p.protocol} for p in sl.ports],
            "endpoints": eps}


def _ns(namespace: str, k: int) -> str:
    """Scenarios sharing an agent reuse kube-proxy's names (ns1/svc1): the namespace carries k."""
    return f"s{k}-{namespace}"


def objects(group: Group, phase: int) -> list[dict[str, Any]]:
    """The group's manifest: kube-proxy's Service CIDR as a ServiceCIDR object, then per scenario its
    Services and EndpointSlices (less what phase 1 deletes); for a NodeCIDR group, this node's Node
    object with the pod CIDR as its spec.podCIDRs."""
    out: list[dict[str, Any]] = [{"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                                  "metadata": {"name": "kubernetes"},
                                  "spec": {"cidrs": [A.cidr(SERVICE_CIDR)]}}]
    if group.node_cidr:
        out.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                    "spec": {"podCIDR": POD_CIDR, "podCIDRs": [POD_CIDR]}})
    for sc in group.scenarios:
        k = scenario_index(group, sc)
        after = sc.after if phase >= 1 else None
        if after != "service-deleted":
            out += [_service(s, k) for s in sc.services]
        if after not in ("slices-deleted", "service-deleted"):
            out += [_slice(sl, k) for sl in sc.slices]
    return out


def kube_proxy_configuration(group: Group) -> dict[str, Any]:
    """As NewFakeProxier: node name, nodePortAddresses, DetectLocalByCIDR(pod CIDR) or NoOp, masqueradeAll;
    a NodeCIDR group takes the pod CIDR from the Node object (objects()) and is given a clusterCIDR
    holding no pod."""
    cfg: dict[str, Any] = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
                           "hostnameOverride": NODE,
                           "nodePortAddresses": sorted({A.cidr(c) for c in group.nodeport_addresses}),
                           "iptables": {"masqueradeAll": group.masquerade_all}}
    if group.localhost_nodeports is not None:
        cfg["iptables"]["localhostNodePorts"] = group.localhost_nodeports
    if group.node_cidr:
        cfg |= {"detectLocalMode": "NodeCIDR", "clusterCIDR": NO_POD_CIDR}
    elif group.local_detector:
        cfg |= {"detectLocalMode": "ClusterCIDR", "clusterCIDR": POD_CIDR}
    return cfg


def pod_addresses() -> dict[str, set[int]]:
    """Every pod address (endpoint or client) of every group, with the TCP/UDP ports it serves."""
    from tests.conformance.reference import ALL_GROUPS
    pods: dict[str, set[int]] = {}
    for group in ALL_GROUPS:
        for sc in group.scenarios:
            k = scenario_index(group, sc)
            for sl in sc.slices:
                for e in sl.endpoints:
                    pods.setdefault(A.addr(e.ip, k), set()).update(p.port for p in sl.ports)
            for f in sc.flows:
                src = A.addr(f.source, k)
                if src.startswith("10.244."):
                    pods.setdefault(src, set()).add(80)
    return pods
