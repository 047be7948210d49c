"""The generator's node facts beyond what explain sets (the iptables datapath's): masqueradeAll,
kube-proxy's four local-traffic detectors, NodePort addresses other than the node IPs, and the
per-ServicePort fragments assembling to what `build` gives."""

from __future__ import annotations

import ipaddress

from usproxy.model.local_detector import LocalDetector, local_detector
from usproxy.model.service_set import Node, ServiceSet
from usproxy.model import chain_names
from usproxy.offload.iptables import rules
from usproxy.offload.iptables.jumps import Table

from tests.offload.helpers import ep, spn, state

WEB = spn("web", "http")
SVC = chain_names.svc_chain(WEB)
EXT = chain_names.ext_chain(WEB)


def ruleset(node: Node, opts: rules.Options = rules.Options(), **kw: object) -> rules.Ruleset:
    st = state(WEB, "10.96.0.1", 80, [ep("10.244.1.1", node_name="node"), ep("10.244.2.1")],
               node_port=30080, service_type="NodePort", **kw)
    return rules.build(ServiceSet(((st.service_port, st.endpoints),), node), 4, opts)


def chain(rs: rules.Ruleset, name: str, table: Table = "nat") -> list[str]:
    return [r.text() for r in rs.in_chain(table, name)]


MASQ_BASE = f'-A {SVC} -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.1 --dport 80'


def test_masquerade_all_marks_every_clusterip_connection() -> None:
    rs = ruleset(Node("node", masquerade_all=True, cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"),)))
    assert chain(rs, SVC)[0] == f"{MASQ_BASE} -j KUBE-MARK-MASQ"  # masqueradeAll wins over the detector


def test_each_detector_writes_kube_proxys_match() -> None:
    cases = {
        local_detector("ClusterCIDR", cluster_cidrs=("10.244.0.0/16",)): ("! -s 10.244.0.0/16", "-s 10.244.0.0/16"),
        local_detector("NodeCIDR", node_cidrs=("10.244.1.0/24",)): ("! -s 10.244.1.0/24", "-s 10.244.1.0/24"),
        local_detector("BridgeInterface", bridge="cbr0"): ("! -i cbr0", "-i cbr0"),
        local_detector("InterfaceNamePrefix", prefix="veth"): ("! -i veth+", "-i veth+"),
    }
    for det, (not_local, local) in cases.items():
        rs = ruleset(Node("node", detector=det))
        assert chain(rs, SVC)[0] == f"{MASQ_BASE} {not_local} -j KUBE-MARK-MASQ", det
        rs = ruleset(Node("node", detector=det), external_traffic_policy="Local")
        pod = f'-A {EXT} -m comment --comment "pod traffic for default/web:http external destinations" {local} -j {SVC}'
        assert chain(rs, EXT)[0] == pod, det


def test_a_connection_from_the_clusterip_itself_is_masqueraded_where_nothing_else_does() -> None:
    """The datapath's option (not kube-proxy's rule): a node process connecting to a ClusterIP
    without binding has the ClusterIP as its source (a local address here); with no detector and
    no masqueradeAll that connection alone is marked. Explain's default leaves it out."""
    own = rules.Options(service_address_source=True)
    mark = (f'-A {SVC} -m comment --comment "default/web:http connection from the cluster IP itself" -m tcp -p tcp '
            f"-s 10.96.0.1 -d 10.96.0.1 --dport 80 -j KUBE-MARK-MASQ")
    assert chain(ruleset(Node("node"), own), SVC)[0] == mark
    assert not any("KUBE-MARK-MASQ" in line for line in chain(ruleset(Node("node")), SVC))
    det = local_detector("ClusterCIDR", cluster_cidrs=("10.244.0.0/16",))
    for node in (Node("node", detector=det), Node("node", masquerade_all=True)):  # already masqueraded there
        assert [line for line in chain(ruleset(node, own), SVC) if "KUBE-MARK-MASQ" in line] == \
            [line for line in chain(ruleset(node), SVC) if "KUBE-MARK-MASQ" in line]


def test_a_detector_without_a_cidr_of_the_family_detects_nothing() -> None:
    rs = ruleset(Node("node", detector=LocalDetector("ClusterCIDR", (ipaddress.ip_network("fd00::/64"),))))
    assert not any("KUBE-MARK-MASQ" in line for line in chain(rs, SVC))


def test_nodeport_addresses_other_than_the_node_ips() -> None:
    tail = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
    ip = ipaddress.ip_address
    every = ruleset(Node("node", ips=(ip("192.0.2.10"),), nodeport_match_all=True))
    assert [r for r in chain(every, rules.SERVICES) if tail in r] == \
        [f'-A KUBE-SERVICES -m comment --comment "{tail}" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS']
    some = ruleset(Node("node", ips=(ip("192.0.2.10"),), nodeport_ips=(ip("192.0.2.11"),)))
    assert [r for r in chain(some, rules.SERVICES) if tail in r] == \
        [f'-A KUBE-SERVICES -m comment --comment "{tail}" -d 192.0.2.11 -j KUBE-NODEPORTS']
    none = ruleset(Node("node", nodeport_ips=()))  # restricted to addresses this node lacks: no NodePorts
    assert not [r for r in chain(none, rules.SERVICES) if tail in r]


def test_fragments_assemble_to_what_build_gives() -> None:
    states = [state(spn(f"s{i}"), f"10.96.0.{i}", 80, [ep(f"10.244.{i}.1")]) for i in range(1, 6)]
    ss = ServiceSet(tuple((st.service_port, st.endpoints) for st in states), Node("node"))
    ctx = rules.context(ss.node, 4, rules.Options(), 5)
    parts = [rules.port_ruleset(ctx, fp) for fp in ss.family_ports(4)]
    assert rules.render_ruleset(rules.assemble(ctx, parts)) == rules.render_ruleset(rules.build(ss, 4))
