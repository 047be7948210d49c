"""ServiceCIDR: the networking.k8s.io/v1 ServiceCIDR objects naming the cluster's Service ranges,
and the union the datapaths check.

As kube-proxy (pkg/proxy/config/config.go ServiceCIDRConfig): every object's `spec.cidrs` counts,
whatever its status says (kube-proxy reads no condition), and after each change the handlers get
the complete set (OnServiceCIDRsChanged). Two differences, both on the safe side: the union is
recomputed from every object, so deleting one of two objects that name the same CIDR keeps the
CIDR (kube-proxy's string set drops it); and overlapping CIDRs are collapsed, because nftables
refuses overlapping intervals in one anonymous set.

Invariants: `ServiceCIDRTracker.cidrs` is the collapsed union of the objects it holds, IPv4 first;
its `on_change` is called exactly when that union changes. An object that does not parse keeps
its previous version (the caller's ObjectCache) and names the field.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from usproxy.util.errors import ConfigError
from usproxy.model.fields import is_dns1123_subdomain
from usproxy.model.types import IPNetwork, parse_cidr_sloppy

SERVICE_CIDR_KIND = "ServiceCIDR"


@dataclass(frozen=True, slots=True)
class ServiceCIDR:
    """One ServiceCIDR object (cluster-scoped): its name and its CIDRs (spec.cidrs, at most one per
    family in a valid object; more are taken as given)."""

    name: str
    cidrs: tuple[IPNetwork, ...]


def parse_service_cidr(raw: Mapping[str, Any]) -> ServiceCIDR:
    """A raw ServiceCIDR object -> ServiceCIDR. CIDRs are read as kube-proxy's ParseCIDRSloppy
    (host bits and leading zeros allowed). Raises ConfigError naming the object and the field."""
    meta = raw.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ConfigError("required", obj=SERVICE_CIDR_KIND, field="metadata.name")
    # a name that is not a DNS-1123 subdomain is quoted, so it cannot forge log lines
    obj = f"{SERVICE_CIDR_KIND} {name if is_dns1123_subdomain(name) else repr(name)}"
    spec = raw.get("spec")
    texts = spec.get("cidrs") if isinstance(spec, Mapping) else None
    if texts is None:
        texts = []
    if not isinstance(texts, list):
        raise ConfigError(f"must be a list, got {type(texts).__name__}", obj=obj, field="spec.cidrs")
    cidrs = []
    for i, text in enumerate(texts):
        try:
            if not isinstance(text, str) or "/" not in text:
                raise ValueError("must be a CIDR (address/prefix length)")
            cidrs.append(parse_cidr_sloppy(text))
        except ValueError as err:
            raise ConfigError(f"{text!r}: {err}", obj=obj, field=f"spec.cidrs[{i}]") from None
    return ServiceCIDR(name, tuple(cidrs))


def union(*groups: Iterable[IPNetwork]) -> tuple[IPNetwork, ...]:
    """Every network of `groups`, overlaps collapsed, IPv4 first, each family sorted."""
    nets = [n for g in groups for n in g]
    v4 = ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv4Network))
    v6 = ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv6Network))
    return (*v4, *v6)


class ServiceCIDRTracker:
    """The ServiceCIDR objects a source has seen, by name, and their union. `update(previous,
    current)` takes (None, new), (old, new) and (old, None) pairs, as a Provider's handlers do;
    `on_change(cidrs)` is called when the union changes."""

    def __init__(self, on_change: Callable[[tuple[IPNetwork, ...]], None]) -> None:
        self.on_change = on_change
        self.objects: dict[str, ServiceCIDR] = {}
        self.cidrs: tuple[IPNetwork, ...] = ()

    def update(self, previous: ServiceCIDR | None, current: ServiceCIDR | None) -> None:
        if previous is not None:
            self.objects.pop(previous.name, None)
        if current is not None:
            self.objects[current.name] = current
        self._recompute()

    def replace(self, objects: Iterable[ServiceCIDR]) -> None:
        """The complete set of objects now (a static source's reload)."""
        self.objects = {o.name: o for o in objects}
        self._recompute()

    def _recompute(self) -> None:
        cidrs = union(*(o.cidrs for o in self.objects.values()))
        if cidrs != self.cidrs:
            self.cidrs = cidrs
            self.on_change(cidrs)
