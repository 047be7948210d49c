"""Lean imports: a library package whose `__init__` imports far more than usproxy uses, registered
with that `__init__` not run.

Importing a submodule runs every parent package's `__init__` first. Two libraries' `__init__`
files import everything they have:
- pyroute2's imports NDB (and sqlite3), IPDB, wireguard, nl80211, plan9 and 160 modules in all:
  5.6 MiB of RSS and 24 ms, measured with ru_maxrss against the three modules usproxy uses
  (iproute, conntrack, ipvs; pyroute2 0.9.7, Python 3.11);
- kubernetes_asyncio's (sources/kube_client.py): 38 MiB.

`stub_package(name, exports)` registers `name` as a module over the package's own directory, so
its submodules import as usual, with a module `__getattr__` (PEP 562): a name in `exports` is taken
from the submodule that defines it at its first use (`from pyroute2 import IPRoute` imports
pyroute2.iproute), a submodule's name imports the submodule; any other name runs the package's
real `__init__` into the stub first, so the package is then whole and answers as it always does.
Never wrong, at worst the old cost.

Invariants: a package already imported is left as it is (False); a package that cannot be stubbed
(not found, not a package) is left to the usual import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping

PYROUTE2_EXPORTS = {
    "IPRoute": "pyroute2.iproute",
    "Conntrack": "pyroute2.conntrack",
    "IPVS": "pyroute2.ipvs",
    "IPVSService": "pyroute2.ipvs",
    "IPVSDest": "pyroute2.ipvs",
}


def lean_pyroute2() -> bool:
    """pyroute2 without its package `__init__` (once per process, before its first import)."""
    return stub_package("pyroute2", PYROUTE2_EXPORTS)


def stub_package(name: str, exports: Mapping[str, str]) -> bool:
    """Register package `name` with its `__init__` not run; True when it was. `exports` maps the
    names usproxy takes from the package itself to the submodule defining each."""
    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return False
    pkg = types.ModuleType(name, f"{name}, its __init__ not run until needed (usproxy.util.lean_import)")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__package__ = name
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    setattr(pkg, "__getattr__", _lazy(pkg, dict(exports)))
    sys.modules[name] = pkg
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, pkg)
    return True


def _lazy(pkg: types.ModuleType, exports: dict[str, str]) -> Callable[[str], object]:
    """The stub's module `__getattr__`."""
    def attr(attr_name: str) -> object:
        if attr_name.startswith("__"):  # probes (__all__, __path__ hooks, __warningregistry__): no init
            raise AttributeError(f"module {pkg.__name__!r} has no attribute {attr_name!r}")
        module = exports.get(attr_name)
        if module is not None:
            value = getattr(importlib.import_module(module), attr_name)
        elif importlib.util.find_spec(f"{pkg.__name__}.{attr_name}") is not None:  # a submodule
            value = importlib.import_module(f"{pkg.__name__}.{attr_name}")
        else:
            _whole(pkg)
            if attr_name not in vars(pkg):
                raise AttributeError(f"module {pkg.__name__!r} has no attribute {attr_name!r}")
            value = vars(pkg)[attr_name]
        setattr(pkg, attr_name, value)
        return value
    return attr


def _whole(pkg: types.ModuleType) -> None:
    """Run the package's real `__init__` into the stub, once: it is then the package itself."""
    if vars(pkg).pop("__getattr__", None) is None:
        return
    assert pkg.__spec__ is not None and pkg.__spec__.loader is not None
    pkg.__spec__.loader.exec_module(pkg)
