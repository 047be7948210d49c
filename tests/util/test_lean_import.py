"""lean_import: pyroute2 without its package __init__, each case in a fresh interpreter (this one
holds the whole library already): the names usproxy takes from it work and the rest of the
library (NDB, sqlite3) is not imported; any other name makes the package whole, as before."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys
from usproxy.util.lean_import import lean_pyroute2
out = {"stubbed": lean_pyroute2(), "again": lean_pyroute2()}
from pyroute2 import IPRoute, Conntrack, IPVS, IPVSService, IPVSDest
from pyroute2 import netns
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple
import pyroute2
with IPRoute() as ipr:
    out["links"] = len(ipr.get_links())
out["lean"] = [m for m in ("pyroute2.ndb", "pyroute2.ipdb", "sqlite3") if m in sys.modules]
out["has_all"] = hasattr(pyroute2, "__all__")
if sys.argv[1] == "other":
    from pyroute2 import NDB
    out["ndb"] = NDB.__module__
    out["version"] = pyroute2.__version__
    out["whole"] = [m for m in ("pyroute2.ndb", "pyroute2.ipdb") if m in sys.modules]
print(json.dumps(out))
"""


def run(how: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, how], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_names_usproxy_uses_load_without_the_rest_of_pyroute2() -> None:
    got = run("lean")
    assert got["stubbed"] is True and got["again"] is False
    assert isinstance(got["links"], int) and got["links"] >= 1  # lo at least: IPRoute talks to the kernel
    assert got["lean"] == []  # NDB, IPDB and sqlite3 never imported
    assert got["has_all"] is False  # a dunder probe does not run the package's __init__


def test_any_other_name_makes_the_package_whole() -> None:
    got = run("other")
    assert got["lean"] == []
    assert got["ndb"] == "pyroute2.ndb.main"
    assert got["version"] != "unknown" and got["whole"] == ["pyroute2.ndb", "pyroute2.ipdb"]
