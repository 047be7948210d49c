"""ReadBack: what one family's iptables holds of the datapath, from iptables-save.

After a restart the agent adopts what the kernel holds instead of rebuilding it from empty (field
case C20). kube-proxy's rules name their ServicePort in comments: "ns/name:port cluster IP",
"... external IP", "... loadbalancer IP", "... has no endpoints", "... has no local endpoints",
"... traffic not accepted by KUBE-FW-...", and the bare name on a NodePort rule; the rule's `-p`
gives the protocol. A ServicePort's endpoints are the DNAT destinations of the KUBE-SEP-* chains
its KUBE-SVC-* / KUBE-SVL-* chains (named from the ServicePortName) jump to; in large-cluster mode
those chains carry no comment, and are still found by name. Health check rules are skipped: they
are always `-p tcp`, whatever the ServicePort's protocol.

Also read: the per-ServicePort chains present (a full sync deletes those no longer wanted, as
kube-proxy's "delete chains no longer in use"), the rules in built-in chains (which entry jumps
exist), and whether the canary chains are there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from usproxy.model import chain_names
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import PROTOCOLS, ServicePortName
from usproxy.offload.iptables import names
from usproxy.offload.iptables.jumps import BUILTIN
from usproxy.offload.iptables.saved import SavedRule, SavedTable

_SUFFIXES = (" cluster IP", " external IP", " loadbalancer IP", " has no endpoints", " has no local endpoints")
_NOT_ACCEPTED = " traffic not accepted by "
_SCANNED = {"nat": (names.SERVICES, names.NODEPORTS),
            "filter": (names.SERVICES, names.NODEPORTS, names.EXTERNAL_SERVICES, names.PROXY_FIREWALL)}


@dataclass
class ReadBack:
    """One family's datapath state as the kernel holds it."""

    ports: dict[ServicePortName, tuple[Endpoint, ...]] = field(default_factory=dict)
    service_chains: set[str] = field(default_factory=set)  # nat per-ServicePort chains
    builtin_rules: dict[str, set[str]] = field(default_factory=dict)  # table -> "-A BASE spec" lines
    top_chains: bool = False  # nat KUBE-SERVICES exists: an earlier run's rules are there
    canary: bool = False  # KUBE-PROXY-CANARY in every table it belongs to


def read(tables: Mapping[str, SavedTable]) -> ReadBack:
    nat = tables.get("nat")
    out = ReadBack()
    if nat is not None:
        out.service_chains = {c for c in nat.user_chains() if names.is_service_chain(c)}
        out.top_chains = names.SERVICES in nat.chains
    out.canary = all(t in tables and names.CANARY in tables[t].chains for t in names.CANARY_TABLES)
    for table, bases in BUILTIN.items():
        saved = tables.get(table)
        out.builtin_rules[table] = {r.text() for b in bases for r in (saved.in_chain(b) if saved else ())}
    for spn in _service_ports(tables):
        out.ports[spn] = _endpoints(spn, nat) if nat is not None else ()
    return out


def _service_ports(tables: Mapping[str, SavedTable]) -> set[ServicePortName]:
    found = set()
    for table, chains in _SCANNED.items():
        saved = tables.get(table)
        for chain in chains if saved is not None else ():
            for rule in saved.in_chain(chain):  # type: ignore[union-attr]
                spn = service_port_of(rule)
                if spn is not None:
                    found.add(spn)
    return found


def service_port_of(rule: SavedRule) -> ServicePortName | None:
    """The ServicePort a capture or refusal rule names in its comment, with its `-p`."""
    comment, proto = rule.comment, (rule.protocol or "").upper()
    if comment is None or proto not in PROTOCOLS:
        return None
    text = next((comment[:-len(s)] for s in _SUFFIXES if comment.endswith(s)), None)
    if text is None and _NOT_ACCEPTED in comment:
        text = comment.split(_NOT_ACCEPTED, 1)[0]
    if text is None and " " not in comment:
        text = comment  # a NodePort rule: the name alone
    return parse_name(text, proto) if text else None


def parse_name(text: str, proto: str) -> ServicePortName | None:
    """"ns/name:port" (or "ns/name") and a protocol back to the ServicePortName."""
    namespace, _, rest = text.partition("/")
    name, _, port = rest.partition(":")
    if not namespace or not name or "/" in rest:
        return None
    return ServicePortName.from_key(f"{namespace}/{name}{':' + port if port else ''}/{proto}")


def _endpoints(spn: ServicePortName, nat: SavedTable) -> tuple[Endpoint, ...]:
    out: dict[str, Endpoint] = {}
    for chain in (chain_names.svc_chain(spn), chain_names.svl_chain(spn)):
        for rule in nat.in_chain(chain):
            target = rule.target or ""
            if not target.startswith("KUBE-SEP-"):
                continue
            for sep_rule in nat.in_chain(target):
                ep = _destination(sep_rule.to_destination)
                if ep is not None:
                    out[str(ep)] = ep
    return tuple(sorted(out.values()))


def _destination(text: str | None) -> Endpoint | None:
    """"10.0.0.1:80" or "[fd00::1]:80" -> Endpoint; None when it is not one."""
    if not text:
        return None
    host, _, port = text.rpartition(":")
    try:
        return Endpoint(ipaddress.ip_address(host.strip("[]")), int(port))
    except ValueError:
        return None
