"""BlockYaml (usproxy/model/block_yaml.py) against PyYAML: every text it reads gives PyYAML's
value; every text it does not take raises Unsupported (never a different value). Hand-picked
YAML 1.1 corner cases, kubectl's layout, and random documents dumped by PyYAML in several styles."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from usproxy.model import block_yaml

CORNERS = [
    "a: |\n  x", "a: |\n  x\n\n\n", "a: |-\n  x\n\n", "a: |\n  x\n\n  y\n", "a: |\n\n  x\n", "a: |\n  x\n b: 1",
    '- a: |\n    {"k": 1}\n  b: 2', "a:\n- 1\n- 2\nb: 3", "a: b\n  c",
    "a: yes\nb: 0755\nc: 0x1f\nd: 1_000\ne: 1:30\nf: ~\ng: 2001-12-14\nh: .inf\ni: -.5\nj: '+1'\nk: 'it''s'\nl: {}\nm: []",
    "  - a: 1\n    b: 2\n  - c\n", "a:\n  b:\n    c: 1\n  d: 2\ne: 3", "- - a", "a: b: c", 'a: "x\\ny"', "k: v # c",
    "# c\na: 1\n\n# d\n", "a:\n\n  - 1\n\n  - 2\n", "- a\n  b", "a:\nb:", "x: -1\ny: -\n", "true: 1\n1: a\nnull: b",
    "a: 'x'\nb: \"y z\"\nc: 'q' # c", "a:\tb", "a: b\r\nc: d", "<<: {a: 1}", "a: &x 1\nb: *x", "a: !!str 1",
    "a: [1, 2]", "a: {b: 1}", "a: >\n  folded\n", "a: |+\n  keep\n\n", "? a\n: b", "'a': 1", "a: =", "a:  spaced  ",
    "a:\n  - b: 1\n    c:\n    - d\n  - e\n", "a:\n- b\n  - c", "a: 1\n  b: 2", "- a: 1\n - b: 2", "a: \u0085b", "\ufeffa: 1",
    "a: |\n    x\n  y\n", "a: |\n  x\n   \n  y\n", "a: http://x/#f", "a: x#y", "a: 1e3\nb: 1.5e3\nc: .5\nd: 0.5\ne: 0o7",
    "a: 2001-12-14t21:59:43.10-05:00", "a: True\nb: NO\nc: On\nd: off\ne: Null\nf: NULL", "a:\n  # c\n  b: 1\n",
    "a: b\n\n\nc: d\n", "-1: x", "a:b: c", "a: 'x\n  y'", "- 'a'\n- \"b\"\n- c d\n", "a: |-\n  x\n  y", "",
]


def _pyyaml(text: str) -> tuple[str, Any]:
    try:
        return "ok", yaml.safe_load(text)
    except yaml.YAMLError as err:
        return "error", type(err).__name__


def _agrees(text: str) -> bool:
    """BlockYaml gives PyYAML's value, or says it does not take the text; returns whether it took it."""
    try:
        got = block_yaml.load(text)
    except block_yaml.Unsupported:
        return False
    assert _pyyaml(text) == ("ok", got), text
    return True


@pytest.mark.parametrize("text", CORNERS)
def test_corner_cases_read_as_pyyaml_reads_them_or_left_to_it(text: str) -> None:
    _agrees(text)


KUBECTL = """\
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      kubectl.kubernetes.io/last-applied-configuration: |
        {"apiVersion":"v1","kind":"Service","metadata":{"annotations":{},"name":"web","namespace":"default"}}
    creationTimestamp: "2026-11-30T10:00:00Z"
    labels:
      app: web
    name: web
    namespace: default
    resourceVersion: "1234"
    uid: 0b6f0e55-8a7f-4d0c-9d1f-2f0a8f7e1c11
  spec:
    clusterIP: 10.96.0.10
    clusterIPs:
    - 10.96.0.10
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ipFamilyPolicy: SingleStack
    ports:
    - name: http
      port: 80
      protocol: TCP
      targetPort: 8080
    selector:
      app: web
    sessionAffinity: None
    type: ClusterIP
  status:
    loadBalancer: {}
"""


def test_kubectl_output_is_read_without_pyyaml() -> None:
    """The layout kubectl prints, the last-applied annotation's block scalar included, is taken."""
    assert _agrees(KUBECTL)


_KEYS = ["a", "name", "ports", "x-y", "with space", "1", "true", "null", "yes", "0755", "a.b/c", "k8s.io/name"]
_SCALARS: list[Any] = [
    "", " lead", "trail ", "a: b", "#x", "x #y", "- x", "yes", "No", "on", "0755", "0x1F", "1_000", "1:30", "~",
    "null", "2001-12-14", ".inf", "-.5", "+1", "it's", 'q"uote', "back\\slash", "multi\nline", "tab\there", "{}", "[]",
    "|", ">", "&a", "*a", "!t", "%", "@", "`", "?", ":", "-", "---", "...", "x: ", "10.96.0.1", "2001:db8::1", "TCP",
    "\u00e9t\u00e9", "\u2028", 0, -1, 3.5, True, False, None, 65535, 10**20, "very long " * 12,
]


_PLAIN: list[Any] = ["web", "TCP", "10.244.1.2", "kubernetes.io/service-name", 8080, "true", "", "a b", True, None]


def _random_value(rng: random.Random, depth: int) -> Any:
    roll = rng.random()
    if depth < 4 and roll < 0.3:
        return {rng.choice(_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if depth < 4 and roll < 0.5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice(_SCALARS if roll < 0.6 else _PLAIN)


@pytest.mark.parametrize("seed", range(6))
def test_random_documents_dumped_by_pyyaml(seed: int) -> None:
    """Random documents in PyYAML's block styles (indentation 2 and 4, kubectl's sequences at the
    key's column): every one BlockYaml takes reads as PyYAML reads it."""
    rng = random.Random(seed)
    taken = total = 0
    for _ in range(150):
        value = {rng.choice(_KEYS): _random_value(rng, 1) for _ in range(rng.randint(1, 5))}
        text = yaml.safe_dump(value, default_flow_style=False, indent=rng.choice([2, 4]), width=rng.choice([40, 80, 10**6]),
                              allow_unicode=rng.random() < 0.5, sort_keys=rng.random() < 0.5)
        total += 1
        taken += _agrees(text)
    assert taken > total // 10  # not vacuous: many documents hold a scalar it leaves to PyYAML
