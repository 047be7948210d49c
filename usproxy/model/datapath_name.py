"""The names of usproxy's datapaths: the words of --offload, the annotation usproxy.io/datapath,
/services and the placement metrics.

`KernelDatapathName` lists the kernel datapaths in the order of the ladder (best first); each has
one declaration in usproxy/offload/registry.py, which checks at import that its entries and this
Literal agree, so a name can be neither missing nor extra. The model layer keeps only the words
(it validates the annotation), never what the datapaths are.
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

KernelDatapathName: TypeAlias = Literal["bpf", "nftables", "ipvs", "iptables"]
USERSPACE: Literal["userspace"] = "userspace"  # the relay, as kube-proxy 1.0's userspace mode
DatapathName: TypeAlias = Literal["userspace", KernelDatapathName]
OffloadMode: TypeAlias = Literal["auto", KernelDatapathName, "none"]

KERNEL_DATAPATH_NAMES: tuple[KernelDatapathName, ...] = get_args(KernelDatapathName)
DATAPATH_NAMES: tuple[DatapathName, ...] = get_args(DatapathName)
OFFLOAD_MODES: tuple[OffloadMode, ...] = get_args(OffloadMode)
