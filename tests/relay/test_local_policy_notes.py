"""What /services says of a Local traffic policy that leaves no local endpoint while the Service
has endpoints elsewhere (relay.local_policy_notes, appended to the relay's Placement reason): the
relay drops as kube-proxy drops, pods and the node excepted for externalTrafficPolicy Local.
Nothing is said where a local endpoint serves, or without any endpoint (refused)."""

from __future__ import annotations

from usproxy.relay.relay import local_policy_notes

from tests.offload.helpers import ep, spn, state

WEB = spn("web", "http")
NP = {"node_port": 30080, "service_type": "NodePort"}


def test_cluster_policies_say_nothing() -> None:
    assert local_policy_notes(state(WEB, "10.96.0.1", 80, [ep("10.244.2.5", node_name="other")], **NP)) == []
    assert local_policy_notes(state(WEB, "10.96.0.1", 80, [], internal_traffic_policy="Local", **NP)) == []


def test_local_policies_without_local_endpoint_drop_and_say_so() -> None:
    remote = [ep("10.244.2.5", node_name="other")]
    itp = local_policy_notes(state(WEB, "10.96.0.1", 80, remote, internal_traffic_policy="Local"))
    assert itp == ["internalTrafficPolicy Local without a local endpoint: ClusterIP connections dropped"]
    etp = local_policy_notes(state(WEB, "10.96.0.1", 80, remote, external_traffic_policy="Local", **NP))
    assert etp == ["externalTrafficPolicy Local without a local endpoint: outside clients dropped, "
                   "pods and the node sent to every endpoint"]


def test_local_external_policy_with_a_local_endpoint_says_nothing() -> None:
    eps = [ep("10.244.1.5", node_name="node"), ep("10.244.2.5", node_name="other")]
    assert local_policy_notes(state(WEB, "10.96.0.1", 80, eps, external_traffic_policy="Local", **NP)) == []
