"""The registry of kernel datapaths: one declaration each, in the order of the ladder.

Everything that depends on which kernel datapaths exist is derived from KERNEL_DATAPATHS: the
`--offload` choices (through usproxy.model.datapath_name's Literals), the `auto` ladder (per
traffic kind and per ServicePort the first datapath that probes available and can serve it, the
relay below the last), the leftovers an agent removes at start for the datapaths it does not use
(as kube-proxy's platformCleanup), what `--cleanup` removes, `usproxy check`'s probes, the locks an
agent takes and the LB policies placement allows.

Adding a kernel datapath: a package under usproxy/offload/ with its KernelDatapath and a
`declaration` module, its name in datapath_name.KernelDatapathName (at its rung of the ladder), and
its DECLARATION in KERNEL_DATAPATHS below. Importing this module loads no datapath code.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from usproxy.model.datapath_name import KERNEL_DATAPATH_NAMES, OffloadMode
from usproxy.offload.bpf.declaration import DECLARATION as BPF
from usproxy.offload.kernel_datapath import BuildContext, KernelDatapath, KernelDatapathDeclaration
from usproxy.offload.iptables.declaration import DECLARATION as IPTABLES
from usproxy.offload.ipvs.declaration import DECLARATION as IPVS
from usproxy.offload.nftables.declaration import DECLARATION as NFTABLES

log = logging.getLogger(__name__)

KERNEL_DATAPATHS: tuple[KernelDatapathDeclaration, ...] = (BPF, NFTABLES, IPVS, IPTABLES)
BY_NAME: dict[str, KernelDatapathDeclaration] = {d.name: d for d in KERNEL_DATAPATHS}

if tuple(BY_NAME) != KERNEL_DATAPATH_NAMES:  # the Literal and the registry must list the same ladder
    raise ImportError(f"kernel datapaths declared {tuple(BY_NAME)} but named {KERNEL_DATAPATH_NAMES} "
                      "in usproxy/model/datapath_name.py")


def allowed(mode: OffloadMode) -> tuple[KernelDatapathDeclaration, ...]:
    """The kernel datapaths `--offload mode` allows, best first: all of them for `auto`, the one
    named, or none."""
    if mode == "auto":
        return KERNEL_DATAPATHS
    return tuple(d for d in KERNEL_DATAPATHS if d.name == mode)


def build(ctx: BuildContext) -> list[KernelDatapath]:
    """The kernel datapaths `--offload` allows, built, best first. One that cannot even be
    constructed (e.g. no libbpf) is left out with a log line; the ladder goes on below it."""
    out: list[KernelDatapath] = []
    for d in allowed(ctx.settings.mode):
        try:
            k = d.build(ctx)
        except Exception as err:
            log.warning("%s datapath not loaded: %s", d.name, err)
            continue
        if k is not None:
            out.append(k)
    return out


def unused(used: Collection[str]) -> tuple[KernelDatapathDeclaration, ...]:
    """The kernel datapaths a run that built `used` does not use: their leftovers go at start."""
    return tuple(d for d in KERNEL_DATAPATHS if d.name not in used)
