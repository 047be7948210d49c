"""The example deployment manifests (examples/kubernetes) as the tests read them: every document
by (kind, name), and the DaemonSet and ConfigMap the image and the systemd unit tests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"


def docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for f in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc["apiVersion"] and doc["metadata"]["name"], f
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def daemonset() -> dict[str, Any]:
    return docs()[("DaemonSet", "usproxy")]


def config_map() -> dict[str, Any]:
    return docs()[("ConfigMap", "usproxy")]
