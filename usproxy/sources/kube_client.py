"""kubernetes_asyncio's ApiClient, Configuration and kubeconfig loaders, without its generated API
and model classes.

usproxy reads the API server as raw JSON (api_list_watch.py: `call_api` with
`_preload_content=False`), so of kubernetes_asyncio it uses the configuration (kubeconfig, exec
and OIDC credentials, in-cluster token and CA), TLS and authentication: never one of the 767
generated model classes nor the 65 API classes. Yet the package's `__init__` files import them
all: `import kubernetes_asyncio.client` cost 38 MiB of RSS and 0.25 s here (Python 3.11,
kubernetes_asyncio 36.1; measured with ru_maxrss against a bare interpreter), the whole difference
between a Kubernetes-mode agent's RSS and a static one's at 1,000 Services.

`load()` registers the three packages whose `__init__` pulls those in (`kubernetes_asyncio`,
`.client`, `.client.models`) as plain namespace-like modules over their own directories, then
imports only the submodules named in NEEDED; the names the rest of the library takes from
`kubernetes_asyncio.client` (ApiClient, Configuration) are set on it. Submodules the library
imports itself (rest, exceptions, the config package) load as usual. If anything of that fails
(another layout in another release), the stubs are removed and the library is imported whole,
as before: slower, never wrong. A process that imported kubernetes_asyncio before keeps it as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

log = logging.getLogger(__name__)

STUBBED = ("kubernetes_asyncio", "kubernetes_asyncio.client", "kubernetes_asyncio.client.models")
NEEDED = ("kubernetes_asyncio.client.configuration", "kubernetes_asyncio.client.api_client",
          "kubernetes_asyncio.config.config_exception", "kubernetes_asyncio.config.incluster_config",
          "kubernetes_asyncio.config.kube_config")


def load() -> None:
    """Import the NEEDED modules, lean when possible (once per process); the callers then
    import what they use from kubernetes_asyncio as usual."""
    if "kubernetes_asyncio" not in sys.modules:
        try:
            _stub_packages()
            for name in NEEDED:
                importlib.import_module(name)
            return
        except Exception as err:  # noqa: BLE001 - the whole library still works
            log.debug("kubernetes_asyncio without its models: %s; importing it whole", err)
            for name in [m for m in sys.modules if m == "kubernetes_asyncio" or m.startswith("kubernetes_asyncio.")]:
                del sys.modules[name]
    for name in NEEDED:
        importlib.import_module(name)


def _stub_packages() -> None:
    for name in STUBBED:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{name}: not a package")
        pkg = types.ModuleType(name, f"{name}, its __init__ not run (usproxy.sources.kube_client)")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__package__ = name
        sys.modules[name] = pkg
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, pkg)
    client = sys.modules["kubernetes_asyncio.client"]
    client.Configuration = importlib.import_module("kubernetes_asyncio.client.configuration").Configuration  # type: ignore[attr-defined]
    client.ApiClient = importlib.import_module("kubernetes_asyncio.client.api_client").ApiClient  # type: ignore[attr-defined]

