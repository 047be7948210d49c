"""The states of kube-proxy's TestSyncProxyRulesRepeated (pkg/proxy/iptables/proxier_test.go and
pkg/proxy/nftables/proxier_test.go), transcribed as manifests under tests/explain/repeated/, on the
node of kube-proxy's NewFakeProxier (test_partial_sync, test_diff)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set

REPEATED = Path(__file__).parent / "repeated"


# NewFakeProxier: pod CIDR 10.0.0.0/8, node "test-node"; the iptables fake has no
# --nodeport-addresses, so its NodePort tail matches `-m addrtype --dst-type LOCAL`.
NODE = Node("test-node", (), (ipaddress.ip_network("10.0.0.0/8"),))


def state(name: str) -> ServiceSet:
    return service_set(load_manifests(REPEATED / f"{name}.yaml"), NODE)
