"""The tour's Services, as the manifest file `usproxy run --services` reads.

One set of Services for every mode, in namespace `tour`, at each size N (N Services in all):

- `a-first` and `z-last`: the Services whose new connections are measured. ServicePortNames sort
  the rules of usproxy's iptables datapath (KUBE-SERVICES), so `a-first` is matched by the first
  rule and `z-last` by the last, after every other Service's (kube-proxy's worst case). Both
  have the five endpoints on MATCH_PORT.
- `uniform`: the five endpoints again, on UNIFORM_PORT, so the endpoints count its connections
  apart from any other Service's: the uniformity test's Service.
- `update`: one endpoint on UPDATE_PORT, UPDATE_ENDPOINTS[0] or [1]; a change replaces it with
  the other (one pod gone, one in its place), and the first connection answered by the new one
  says the change took effect.
- N - 4 fillers `s-00000`...: two endpoints each at addresses where nothing answers (they are
  never connected to), on another node, so no hairpin state is made for them.

They are a directory of two files, as `kubectl get svc,endpointslices -A -o yaml` prints them (a
List, keys sorted, sequences at their key's column: the layout the agent's fast block reader
takes, usproxy/model/block_yaml.py): `services.yaml` with every Service but `update`, and
`update.yaml` with `update` alone, so an endpoint change rewrites a small file, as one
EndpointSlice update from the API server would be, and the agent does not read 10,000 Services
again for it. Files are replaced by a rename: the agent never reads half a file. `kubectl_yaml` is
shared with bench/startup.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMESPACE = "tour"
NODE = "tour-node"  # --hostname-override of the tour's agents; the measured endpoints' nodeName
OTHER_NODE = "tour-other"  # the fillers' endpoints
ENDPOINTS = tuple(f"10.244.1.{i}" for i in range(1, 6))  # five pods' addresses
UPDATE_ENDPOINTS = ("10.244.1.6", "10.244.1.7")
MATCH_PORT, UNIFORM_PORT, UPDATE_PORT = 8080, 8081, 8082
SERVICE_PORT = 80
FIRST_IP, LAST_IP, UNIFORM_IP, UPDATE_IP = "10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.13"
FILLER_BASE = int(ipaddress.ip_address("10.96.1.0"))
FILLER_ENDPOINT_BASE = int(ipaddress.ip_address("10.244.128.0"))
SPECIAL = 4  # the Services above that are not fillers
MAX_SERVICES = 50_000  # ClusterIPs from 10.96.1.0 stay inside 10.96.0.0/16


@dataclass(frozen=True, slots=True)
class Measured:
    """A Service the tour connects to: its ServicePortName as /services shows it, address, port."""

    name: str
    ip: str
    port: int = SERVICE_PORT

    @property
    def key(self) -> str:
        return f"{NAMESPACE}/{self.name}:http"


FIRST, LAST = Measured("a-first", FIRST_IP), Measured("z-last", LAST_IP)
UNIFORM, UPDATE = Measured("uniform", UNIFORM_IP), Measured("update", UPDATE_IP)


def objects(n: int, update_endpoint: str = UPDATE_ENDPOINTS[0]) -> list[dict[str, Any]]:
    """The n Services and their EndpointSlices, `update` served by `update_endpoint`."""
    return update_objects(update_endpoint) + bulk_objects(n)


def update_objects(endpoint: str) -> list[dict[str, Any]]:
    """Service `update` served by `endpoint`."""
    return [service(UPDATE.name, UPDATE.ip, UPDATE_PORT), endpoint_slice(UPDATE.name, (endpoint,), UPDATE_PORT, NODE)]


def bulk_objects(n: int) -> list[dict[str, Any]]:
    """Every Service of size n but `update`."""
    if not SPECIAL <= n <= MAX_SERVICES:
        raise ValueError(f"the tour's sizes are {SPECIAL} to {MAX_SERVICES} Services, got {n}")
    out = []
    for m, eps, port in ((FIRST, ENDPOINTS, MATCH_PORT), (LAST, ENDPOINTS, MATCH_PORT),
                         (UNIFORM, ENDPOINTS, UNIFORM_PORT)):
        out += [service(m.name, m.ip, port), endpoint_slice(m.name, eps, port, NODE)]
    for i in range(n - SPECIAL):
        ip = str(ipaddress.ip_address(FILLER_BASE + i))
        eps = tuple(str(ipaddress.ip_address(FILLER_ENDPOINT_BASE + 2 * i + k)) for k in (0, 1))
        out += [service(f"s-{i:05d}", ip, MATCH_PORT), endpoint_slice(f"s-{i:05d}", eps, MATCH_PORT, OTHER_NODE)]
    return out


def service(name: str, ip: str, target: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "type": "ClusterIP", "sessionAffinity": "None",
                     "ports": [{"name": "http", "port": SERVICE_PORT, "protocol": "TCP", "targetPort": target}]}}


def endpoint_slice(name: str, ips: tuple[str, ...], port: int, node: str) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{name}-tour1", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": name}},
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                           "nodeName": node} for ip in ips],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}


def write(directory: Path, n: int, update_endpoint: str = UPDATE_ENDPOINTS[0]) -> None:
    """The n Services into `directory` (made if missing): both files."""
    directory.mkdir(parents=True, exist_ok=True)
    write_bulk(directory, n)
    write_update(directory, update_endpoint)


def write_bulk(directory: Path, n: int) -> None:
    """`services.yaml` alone: the Services of size n but `update` (a size step)."""
    _replace(directory / "services.yaml", bulk_objects(n))


def write_update(directory: Path, endpoint: str) -> None:
    """`update.yaml` alone: Service `update` now served by `endpoint` (one endpoint replaced)."""
    _replace(directory / "update.yaml", update_objects(endpoint))


def _replace(path: Path, objs: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(kubectl_yaml(objs))
    os.rename(tmp, path)


# -- kubectl's YAML ---------------------------------------------------------------------------------
_PLAIN = re.compile(r"[A-Za-z_./][-A-Za-z0-9_./]*|[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if v == {}:
        return "{}"
    text = str(v)
    if _PLAIN.fullmatch(text) and text.lower() not in ("true", "false", "yes", "no", "on", "off", "null", "y", "n"):
        return text
    return json.dumps(text)  # kubectl double-quotes what would not read back as the same string


def _emit(value: dict[str, Any], indent: int, out: list[str]) -> None:
    pad = " " * indent
    for key in sorted(value):
        v = value[key]
        if isinstance(v, dict) and v:
            out.append(f"{pad}{key}:")
            _emit(v, indent + 2, out)
        elif isinstance(v, list) and v:
            out.append(f"{pad}{key}:")
            _emit_list(v, indent, out)
        else:
            out.append(f"{pad}{key}: {_scalar(v)}")


def _emit_list(items: list[Any], indent: int, out: list[str]) -> None:
    pad = " " * indent
    for item in items:
        if isinstance(item, dict):
            start = len(out)
            _emit(item, indent + 2, out)
            out[start] = pad + "- " + out[start][indent + 2:]
        else:
            out.append(f"{pad}- {_scalar(item)}")


def kubectl_yaml(objects: list[dict[str, Any]]) -> str:
    """`objects` as `kubectl get -o yaml` prints a list: keys sorted, sequences at the key's column."""
    out = ["apiVersion: v1", "items:"]
    _emit_list(objects, 0, out)
    out += ["kind: List", "metadata:", '  resourceVersion: ""']
    return "\n".join(out) + "\n"
