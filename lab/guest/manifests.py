"""The Services the guest's agent serves, as `kubectl get svc,endpointslices -o yaml` prints them
(JSON, which is YAML too), written as the static source reads them.

Kernel scenarios: web (ClusterIP 10.96.0.10:80/TCP), web-np (NodePort 30080 on ClusterIP
10.96.0.11:80/TCP) and dns (ClusterIP 10.96.0.53:53/UDP), every one on all pods (TCP 8080, UDP
5353). The edge machine: N Services of both protocols, each on two pods, with one endpoint's
readiness flipped per change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TCP_PORT = 8080
UDP_PORT = 5353


def service(name: str, ip: str, port: int, proto: str, target: int, node_port: int | None = None) -> dict[str, Any]:
    p: dict[str, Any] = {"name": "p", "port": port, "protocol": proto, "targetPort": target}
    if node_port is not None:
        p["nodePort"] = node_port
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"type": "NodePort" if node_port else "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                     "ipFamilies": ["IPv4"], "ports": [p], "selector": {"app": name}, "sessionAffinity": "None"}}


def slice_(name: str, proto: str, target: int, pods: list[str], ready: list[bool] | None = None) -> dict[str, Any]:
    ready = ready or [True] * len(pods)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-abc", "namespace": "default", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4", "ports": [{"name": "p", "port": target, "protocol": proto}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": r, "serving": r, "terminating": False},
                           "nodeName": "lab"} for ip, r in zip(pods, ready)]}


def write(path: Path, items: list[dict[str, Any]]) -> None:
    """Whole or not at all: a rename, which the static source reads at once."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    os.replace(tmp, path)


def kernel_scenario(directory: Path, pods: list[str]) -> dict[str, tuple[str, int, str]]:
    """Writes the three Services; returns their frontends: name -> (ip, port, protocol)."""
    directory.mkdir(parents=True, exist_ok=True)
    items = [service("web", "10.96.0.10", 80, "TCP", TCP_PORT), slice_("web", "TCP", TCP_PORT, pods),
             service("web-np", "10.96.0.11", 80, "TCP", TCP_PORT, node_port=30080), slice_("web-np", "TCP", TCP_PORT, pods),
             service("dns", "10.96.0.53", 53, "UDP", UDP_PORT), slice_("dns", "UDP", UDP_PORT, pods)]
    write(directory / "services.yaml", items)
    return {"default/web:p": ("10.96.0.10", 80, "TCP"), "default/web-np:p": ("10.96.0.11", 80, "TCP"),
            "default/dns:p": ("10.96.0.53", 53, "UDP")}


def edge_ip(i: int) -> str:
    return f"10.96.{1 + i // 250}.{1 + i % 250}"


def edge(path: Path, n: int, pods: list[str], flipped: int | None = None) -> None:
    """n Services (even ones TCP, odd ones UDP), each on two of the pods; Service `flipped` (if any)
    has its second endpoint not ready."""
    items = []
    for i in range(n):
        proto, target = ("TCP", TCP_PORT) if i % 2 == 0 else ("UDP", UDP_PORT)
        two = [pods[i % len(pods)], pods[(i + 1) % len(pods)]]
        items.append(service(f"s{i}", edge_ip(i), 80, proto, target))
        items.append(slice_(f"s{i}", proto, target, two, [True, i != flipped]))
    write(path, items)
