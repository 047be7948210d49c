"""Every chain explain's rules jump or go to is declared, for the Service whose "uses cluster
endpoints" usproxy once computed differently from kube-proxy (ServicePort.UsesClusterEndpoints:
`!iTPLocal || ExternallyAccessible`): internalTrafficPolicy Local, externalTrafficPolicy Local and
a NodePort. Its external chain short-circuits pod and node traffic to the cluster chain, which
must then exist (iptables KUBE-SVC-..., nftables service-...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from usproxy.explain import cli

BOTH_LOCAL = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.1.1
  internalTrafficPolicy: Local
  externalTrafficPolicy: Local
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a}
- {addresses: [10.244.2.5], nodeName: node-b}
ports: [{name: http, port: 8080}]
"""
BUILTIN = {"ACCEPT", "DROP", "REJECT", "RETURN", "MASQUERADE", "DNAT", "SNAT", "MARK", "CONNMARK", "NFLOG"}


def render(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, *extra: str) -> str:
    f = tmp_path / "svc.yaml"
    f.write_text(BOTH_LOCAL)
    rc = cli.main(["--services", str(f), "--mode", mode, "--node-name", "node-a", "--node-ip", "192.168.0.2",
                   "--cluster-cidr", "10.244.0.0/16", *extra])
    assert rc == 0
    return capsys.readouterr().out


def test_iptables_declares_every_chain_it_jumps_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = render(tmp_path, capsys, "iptables")
    declared = set(re.findall(r"^:(\S+)", out, re.M))
    targets = set(re.findall(r" -[jg] (\S+)", out)) - BUILTIN
    assert "KUBE-SVC-CDGGSHYLG3RE2FKL" in targets  # the short-circuit of the external chain
    assert targets <= declared, targets - declared


def test_nftables_declares_every_chain_it_goes_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = render(tmp_path, capsys, "nftables", "--nft-format", "dump")
    declared = set(re.findall(r"^add chain ip kube-proxy (\S+)", out, re.M))
    targets = set(re.findall(r"\b(?:goto|jump) ([^\s,}]+)", out))
    assert any(t.startswith("service-") for t in targets)
    assert targets <= declared, targets - declared
