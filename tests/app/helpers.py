"""Helpers of the agent tests over a static manifest (tests/app, tests/admin): the one Service
they serve, an atomic manifest write, whether the peer closed a connection, and a /services row."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from usproxy.util.rows import ServiceRow

SVC = """\
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: 10.96.10.10
  ports: [{{name: http, port: {port}, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [10.244.1.5]}}]
"""


def write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.rename(tmp, path)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closed or reset the connection (within 3 s) without sending anything."""
    try:
        return await asyncio.wait_for(reader.read(), 3) == b""
    except ConnectionResetError:
        return True


def service_row(name: str = "default/web:http", *, node_port: int = 0, datapath: str = "userspace",
                reason: str = "relayed", external: str | None = None, external_reason: str = "") -> ServiceRow:
    """A /services row of a ServicePort with one usable endpoint (a NodePort when `node_port`)."""
    return {
        "servicePortName": name, "protocol": "TCP", "clusterIPs": ["10.96.0.10"], "port": 80,
        "nodePort": node_port, "type": "NodePort" if node_port else "ClusterIP", "externalIPs": [],
        "sessionAffinity": "None", "affinityTimeoutSeconds": 10800, "externalTrafficPolicy": "Cluster",
        "internalTrafficPolicy": "Cluster",
        "endpoints": [{"address": "10.244.1.5:8080", "ready": True, "serving": True, "terminating": False,
                       "nodeName": None, "usable": True}],
        "datapath": datapath, "reason": reason, "bpfLbMode": None, "external": external,
        "externalReason": external_reason, "healthCheckNodePort": 0, "healthCheckError": None}
