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
`.client`, `.client.models`) with that `__init__` not run (util/lean_import.py), then imports only
the submodules named in NEEDED; the names the rest of the library takes from
`kubernetes_asyncio.client` (ApiClient, Configuration) come from their submodules (EXPORTS).
Submodules the library imports itself (rest, exceptions, the config package) load as usual. If
anything of that fails (another layout in another release), the stubs are removed and the library
is imported whole, as before: slower, never wrong. A process that imported kubernetes_asyncio before keeps it as it is.
"""

from __future__ import annotations

import importlib
import logging
import sys

from usproxy.util.lean_import import stub_package

log = logging.getLogger(__name__)

STUBBED = ("kubernetes_asyncio", "kubernetes_asyncio.client", "kubernetes_asyncio.client.models")
NEEDED = ("kubernetes_asyncio.client.configuration", "kubernetes_asyncio.client.api_client",
          "kubernetes_asyncio.config.config_exception", "kubernetes_asyncio.config.incluster_config",
          "kubernetes_asyncio.config.kube_config")
EXPORTS = {"kubernetes_asyncio.client": {"ApiClient": "kubernetes_asyncio.client.api_client",
                                         "Configuration": "kubernetes_asyncio.client.configuration"}}


def load() -> None:
    """Import the NEEDED modules, lean when possible (once per process); the callers then
    import what they use from kubernetes_asyncio as usual."""
    if "kubernetes_asyncio" not in sys.modules:
        try:
            _stub_packages()
            _import_needed()
            return
        except Exception as err:  # noqa: BLE001 - the whole library still works
            log.debug("kubernetes_asyncio without its models: %s; importing it whole", err)
            for name in [m for m in sys.modules if m == "kubernetes_asyncio" or m.startswith("kubernetes_asyncio.")]:
                del sys.modules[name]
    _import_needed()


def _import_needed() -> None:
    for name in NEEDED:
        importlib.import_module(name)


def _stub_packages() -> None:
    for name in STUBBED:
        if not stub_package(name, EXPORTS.get(name, {})):
            raise ImportError(f"{name}: not a package")
