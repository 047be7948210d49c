"""The kernel datapath registry (usproxy/offload/registry.py): one declaration per kernel datapath,
from which the --offload choices, the ladder, the leftovers, `usproxy check`'s probes and the LB
policies placement allows are derived.

- The registry and the names Literal (usproxy/model/datapath_name.py) list the same ladder, and
  the CLI offers exactly `auto`, each kernel datapath and `none`.
- Each declaration's `optional` protocols are exactly those its built datapath implements, so a
  caller that checks isinstance finds what the declaration promises.
- `allowed` and `unused` follow --offload; building leaves out a datapath that cannot even be
  constructed and goes on down the ladder.
- LB policies: placement checks membership in the declaration. A policy a datapath does not
  declare (leastConnections today, or the agent's --lb-policy for unannotated ServicePorts)
  stays in the relay with a reason naming the datapath; a declared one is offloaded.
- Importing the registry loads no datapath code (no libbpf binding, no libnftables client).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from usproxy.app.cli import build_parser
from usproxy.core.datapath import (
    ChunkedFlowsView,
    ExternalServing,
    ExternalView,
    KernelWriteCounter,
    FlowsView,
    NodeAddressFollower,
    ServiceCIDRHandler,
    SyncRequest,
    UdpConntrackReconciler,
)
from usproxy.model.datapath_name import KERNEL_DATAPATH_NAMES, KernelDatapathName, OffloadMode
from usproxy.model.node import NodeFacts
from usproxy.offload import registry
from usproxy.offload.fake import FakeKernelDatapath
from usproxy.offload.kernel_datapath import BuildContext, KernelDatapath
from usproxy.offload.manager import OffloadManager
from usproxy.offload.nftables.fake import FakeNftClient
from usproxy.offload.settings import OffloadSettings
from usproxy.util.metrics import Metrics

from tests.offload.helpers import ep, spn, state

OPTIONAL = (NodeAddressFollower, ExternalServing, ServiceCIDRHandler, FlowsView, ChunkedFlowsView, ExternalView,
            UdpConntrackReconciler, KernelWriteCounter)
ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_and_the_names_list_the_same_ladder() -> None:
    assert tuple(d.name for d in registry.KERNEL_DATAPATHS) == KERNEL_DATAPATH_NAMES == get_args(KernelDatapathName)
    offload = next(a for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions  # type: ignore[index, union-attr]
                   if a.dest == "offload")
    assert tuple(offload.choices) == get_args(OffloadMode) == ("auto", *KERNEL_DATAPATH_NAMES, "none")


def settings(mode: OffloadMode, policy: str = "roundRobin") -> OffloadSettings:
    return OffloadSettings(mode, 0.0, policy, Path("/nonexistent"))  # type: ignore[arg-type]


def test_allowed_and_unused_follow_offload() -> None:
    assert registry.allowed("auto") == registry.KERNEL_DATAPATHS
    assert registry.allowed("none") == ()
    for name in KERNEL_DATAPATH_NAMES:
        assert [d.name for d in registry.allowed(name)] == [name]
        assert name not in [d.name for d in registry.unused([name])]
    assert registry.unused([]) == registry.KERNEL_DATAPATHS


@pytest.mark.parametrize("name", KERNEL_DATAPATH_NAMES)
def test_each_datapath_implements_exactly_the_optional_protocols_it_declares(name: str) -> None:
    d = registry.BY_NAME[name]
    k = d.build(BuildContext(settings(name), NodeFacts()))  # type: ignore[arg-type]
    assert k is not None and k.name == name
    try:
        implemented = {p for p in OPTIONAL if isinstance(k, p)}
        assert implemented == set(d.optional), f"{name}: implements {implemented}, declares {set(d.optional)}"
        assert d.serves >= k.traffic
    finally:
        k.close()


def test_a_datapath_that_cannot_be_built_leaves_the_ladder_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: BuildContext) -> KernelDatapath:
        raise OSError("libbpf.so.1: cannot open shared object file")

    unloadable = dataclasses.replace(registry.BY_NAME["bpf"], build=broken)
    monkeypatch.setattr(registry, "KERNEL_DATAPATHS", (unloadable, registry.BY_NAME["nftables"]))
    built = registry.build(BuildContext(settings("auto"), NodeFacts()))
    try:
        assert [k.name for k in built] == ["nftables"]
    finally:
        for k in built:
            k.close()


async def placed(policy: str | None, default: str = "roundRobin") -> str:
    """Where a ServicePort annotated `policy` (None: unannotated, --lb-policy `default`) lands
    with one fake nftables datapath."""
    nft = FakeKernelDatapath("nftables")
    mgr = OffloadManager(settings("auto", default), [nft], request_sync=lambda: None, metrics=Metrics())
    st = state(spn("web"), "10.96.0.1", 80, [ep("10.244.1.1")], lb_policy=policy)
    await mgr.sync(SyncRequest({st.service_port.name: st}))
    p = mgr.placement(st.service_port.name)
    assert p is not None
    await mgr.close()
    return f"{p.datapath}: {p.reason}"


async def test_placement_checks_the_declared_lb_policies() -> None:
    assert (await placed("random")).startswith("nftables: established")
    assert (await placed("roundRobin")).startswith("nftables: established")
    assert (await placed(None)).startswith("nftables: established")
    lc = await placed("leastConnections")
    assert lc.startswith("userspace:") and "lb-policy leastConnections is not served by nftables" in lc, lc
    # unannotated ServicePorts take the agent's --lb-policy: not offloaded as something else
    assert "lb-policy leastConnections is not served by nftables" in await placed(None, "leastConnections")


async def test_a_kernel_datapath_without_a_declaration_serves_no_policy() -> None:
    odd = FakeKernelDatapath("odd")
    mgr = OffloadManager(settings("auto"), [odd], request_sync=lambda: None, metrics=Metrics())
    st = state(spn("web"), "10.96.0.1", 80, [ep("10.244.1.1")])
    await mgr.sync(SyncRequest({st.service_port.name: st}))
    p = mgr.placement(st.service_port.name)
    assert p is not None and p.datapath == "userspace" and "odd declares no LB policies" in p.reason, p
    await mgr.close()


def test_importing_the_registry_loads_no_datapath_code() -> None:
    code = ("import sys, usproxy.offload.registry as r; r.KERNEL_DATAPATHS; "
            "print(' '.join(m for m in sys.modules if m.startswith('usproxy.offload') or m == 'nftables'))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    heavy = [m for m in loaded if m.endswith((".datapath", ".libbpf", ".loader", ".client")) or m == "nftables"]
    assert heavy == [], loaded


def test_the_nftables_probe_is_the_declarations() -> None:
    from usproxy.offload.nftables.declaration import probe_nftables

    assert probe_nftables(FakeNftClient()).available


async def test_nftables_leftovers_on_a_kernel_without_nf_tables_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab's no-nftables guest logged an ERROR at every start: listing the tables fails there
    (EINVAL). Where the probe says nf_tables is missing, nothing can have been left; where it is
    present, a failing listing is still an error."""
    from usproxy.model.config import ProxyConfig
    from usproxy.offload.kernel_datapath import Capability
    from usproxy.offload.nftables import datapath, declaration
    from usproxy.util.errors import OffloadError

    class Failing:
        async def list_table(self, family: str, table: str) -> None:
            raise OffloadError("Invalid argument", 22)

    class NoTables:
        transport = Failing()

        def close(self) -> None:
            pass

    monkeypatch.setattr(datapath, "NftablesDatapath", NoTables)
    monkeypatch.setattr(declaration, "probe_nftables", lambda: Capability("nftables", False, "no nf_tables"))
    assert await declaration.leftovers(ProxyConfig()) == []
    monkeypatch.setattr(declaration, "probe_nftables", lambda: Capability("nftables", True, "present"))
    with pytest.raises(OffloadError):
        await declaration.leftovers(ProxyConfig())
