"""Helpers of the agent tests over a static manifest (tests/app, tests/admin): the one Service
they serve, an atomic manifest write, and whether the peer closed a connection."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

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
