"""What /services says where the relay departs from kube-proxy for Local traffic policies
(relay.local_policy_notes, appended to the relay's Placement reason): refusal where kube-proxy
drops, and no short-circuit of pod and node traffic. Nothing is said when the relay does as
kube-proxy does."""

from __future__ import annotations

from usproxy.relay.relay import local_policy_notes

from tests.offload.helpers import ep, spn, state

WEB = spn("web", "http")
NP = {"node_port": 30080, "service_type": "NodePort"}


def test_cluster_policies_say_nothing() -> None:
    assert local_policy_notes(state(WEB, "10.96.0.1", 80, [ep("10.244.2.5", node_name="other")], **NP)) == []
    assert local_policy_notes(state(WEB, "10.96.0.1", 80, [], internal_traffic_policy="Local", **NP)) == []


def test_local_policies_without_local_endpoint_are_refused_and_say_so() -> None:
    remote = [ep("10.244.2.5", node_name="other")]
    itp = local_policy_notes(state(WEB, "10.96.0.1", 80, remote, internal_traffic_policy="Local"))
    assert itp == ["internalTrafficPolicy Local without a local endpoint: ClusterIP connections refused "
                   "(kube-proxy drops them)"]
    etp = local_policy_notes(state(WEB, "10.96.0.1", 80, remote, external_traffic_policy="Local", **NP))
    assert any("external connections refused (kube-proxy drops them)" in n for n in etp)
    assert any("pods and the node get local endpoints only" in n for n in etp)


def test_local_external_policy_with_a_local_endpoint_names_the_missing_short_circuit() -> None:
    eps = [ep("10.244.1.5", node_name="node"), ep("10.244.2.5", node_name="other")]
    notes = local_policy_notes(state(WEB, "10.96.0.1", 80, eps, external_traffic_policy="Local", **NP))
    assert notes == ["externalTrafficPolicy Local: pods and the node get local endpoints only "
                     "(kube-proxy sends them to every endpoint)"]
