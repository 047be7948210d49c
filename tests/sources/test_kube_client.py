"""kube_client: kubernetes_asyncio's configuration and ApiClient without its generated model and API
classes, each case in a fresh interpreter (this one may hold the whole library already): none of
them is imported, a kubeconfig loads and the client lists from the stand-in API server; when the
packages cannot be stubbed, the library is imported whole and works the same."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources.fake_apiserver import FakeApiServer, kubeconfig_text

PROGRAM = """
import asyncio, json, sys
from pathlib import Path
if sys.argv[2] == "unstubbable":
    import importlib.util
    find = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "kubernetes_asyncio.client.models" else find(name, *a)
from usproxy.sources import kube, kube_client

async def main():
    configuration = await kube.client_config(Path(sys.argv[1]))()
    kube_client.load()
    from kubernetes_asyncio.client import ApiClient
    async with ApiClient(configuration) as api:
        resp = await api.call_api("/api/v1/services", "GET", query_params=[], header_params={"Accept": "application/json"},
                                  auth_settings=["BearerToken"], response_types_map={}, _preload_content=False)
        body = json.loads(await resp.read())
    loaded = [m for m in sys.modules if m.startswith("kubernetes_asyncio")]
    print(json.dumps({"names": [i["metadata"]["name"] for i in body["items"]],
                      "models": len([m for m in loaded if ".client.models." in m]),
                      "apis": len([m for m in loaded if ".client.api." in m])}))
asyncio.run(main())
"""


def _run(kubeconfig: Path, how: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(kubeconfig), how], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("how", ["lean", "unstubbable"])
async def test_the_client_lists_with_or_without_the_generated_classes(tmp_path: Path, how: str) -> None:
    api = FakeApiServer()
    api.apply("services", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
                           "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}})
    await api.start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kubeconfig_text(api.url, api.token))
        got = await asyncio.to_thread(_run, kubeconfig, how)
    finally:
        await api.stop()
    assert got["names"] == ["web"]
    if how == "lean":
        assert got["models"] == 0 and got["apis"] == 0, got
    else:  # imported whole, as before
        assert int(str(got["models"])) > 500, got
