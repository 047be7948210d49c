"""Watching a real agent in a node namespace (tests/relay/harness.AgentProc) from the offload
tests: the `web` Service's objects, a ServicePort's placement in /services, a metric's value, and
waiting for a condition."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

from tests.netns import inside
from tests.relay.harness import AgentProc, slice_, svc

VIP = "10.96.10.10"


def web(eps: list[str], **spec: Any) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", **spec.pop("port_extra", {})}]
    return [svc("web", VIP, ports, **spec),
            slice_("web", [{"ip": e, "ready": True} for e in eps], [{"name": "http", "port": 8080, "protocol": "TCP"}])]


def placement(agent: AgentProc, name: str = "default/web:http") -> tuple[str, str]:
    """(datapath, reason) of one ServicePort in the agent's /services; ("absent", "") if none."""
    for row in agent.services():
        if row["servicePortName"] == name:
            return row["datapath"], row["reason"]
    return ("absent", "")


def datapath_of(agent: AgentProc, name: str) -> str:
    """The datapath serving one ServicePort, "absent" if the agent has none of that name."""
    return placement(agent, name)[0]


def wait_for(pred: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def metric(agent: AgentProc, name: str, labels: str = "") -> float:
    with inside(agent.topo.node):
        text = urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}{{{labels}[^}}]*}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
