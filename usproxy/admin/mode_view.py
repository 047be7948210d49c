"""ModeView: one Service as each proxy mode holds it, for the web view's /view/service and the
standalone page: per mode the rules usproxy.explain renders and the SVG path drawings.

A module of its own so that the agent imports usproxy.explain (~4 MiB of RSS) only when a page
asks for a Service, not at start. Pure functions of their input but `service_set_of`, which
reads the agent's state (on the loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from usproxy.admin import path_drawing
from usproxy.explain import bpf, iptables, ipvs, nftables, userspace
from usproxy.explain.service_set import Node, ServiceSet
from usproxy.model.types import NamespacedName

if TYPE_CHECKING:
    from usproxy.admin.web_view import WebSource


TITLES = {
    "userspace": "userspace: kube-proxy 1.0's proxy, and usproxy's relay",
    "iptables": "iptables: kube-proxy's iptables mode",
    "ipvs": "ipvs: kube-proxy's IPVS mode",
    "nftables": "nftables: kube-proxy's nftables mode",
    "bpf": "bpf: a BPF socket load balancer",
}
RENDERERS: dict[str, Callable[[ServiceSet], str]] = {
    "userspace": userspace.render, "iptables": iptables.render, "ipvs": ipvs.render,
    "nftables": nftables.render, "bpf": bpf.render,
}


def service_set_of(source: WebSource, namespace: str, name: str) -> ServiceSet | None:
    """The ServicePorts of one Service with their endpoints now (read on the loop, where the
    agent's state lives); None when no ServicePort of it is known."""
    ports = tuple((st.service_port, st.endpoints)
                  for st in source.service_ports(NamespacedName(namespace, name)))
    return ServiceSet(ports, Node(name=source.node.name)) if ports else None


def mode_views(ss: ServiceSet) -> list[dict[str, Any]]:
    """Per mode (path_drawing.MODES order): {"mode", "title", "rules": the text usproxy.explain
    renders for `ss`, "svgs": one drawing per ServicePort and IP family}."""
    fps = [fp for family in ss.families() for fp in ss.family_ports(family)]
    return [{"mode": m, "title": TITLES[m], "rules": RENDERERS[m](ss),
             "svgs": [path_drawing.render(path_drawing.path_of(m, fp)) for fp in fps]}
            for m in path_drawing.MODES]
