"""The tc programs through a clsact qdisc and cls_bpf filters: the rung below tcx.

tcx (BPF_TCX_INGRESS/EGRESS links) came in Linux 6.6; before it a program runs at tc as a filter
of the clsact qdisc (Linux 4.5+) in direct-action mode: its return value is the verdict, as with
tcx. `tcx_available` probes which the kernel has (BPF_PROG_QUERY of tcx on `lo`: EINVAL without
it; nothing is attached), so the rung is chosen by what the kernel does, never by its version.

Our filter on an interface is the one at PRIORITY, handle HANDLE, kind bpf, named after its
program (usp_tc_ingress at the clsact's ingress, usp_tc_egress at its egress); nothing else is
ever replaced or deleted. The qdisc is added only where none is, and deleted only where this
module added it (the caller keeps that fact: loader.py pins a marker) and no filter is left on it,
ours or another's. A restart replaces the program of our filter in place (RTM_NEWTFILTER with
NLM_F_REPLACE: the kernel swaps it under RCU, so no packet meets the interface without it).
A filter of another program at our priority and handle makes the attach fail (BpfError EBUSY)
rather than take its place.

rtnetlink through pyroute2, in a thread of its own (pyroute2's synchronous API cannot run inside
the agent's event loop; docs/platform.md): a thread made by the calling thread is in its network
namespace, so the interfaces are the caller's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from usproxy.offload.bpf import libbpf as bpf

T = TypeVar("T")
TcAttach = Literal["tcx", "clsact"]  # how the tc programs attach: the rung probed

TC_H_CLSACT = 0xFFFFFFF1
PARENTS = {"usp_tc_ingress": 0xFFFFFFF2, "usp_tc_egress": 0xFFFFFFF3}  # TC_H_MIN_INGRESS, TC_H_MIN_EGRESS
# After filters at an explicit low priority (Cilium's bpf-filter-priority is 1), before those tc
# numbers itself (49152 downwards): the same place in the chain on every interface.
PRIORITY = 0x2000
HANDLE = 1
TCA_BPF_ID = 11  # not in pyroute2 0.9.7's decoder: read from the attribute's bytes


@dataclass(frozen=True, slots=True)
class Filter:
    """A bpf filter at one of the clsact's parents (ingress or egress)."""

    parent: int
    priority: int
    handle: int
    name: str
    prog_id: int | None


def tcx_available() -> str | None:
    """None when the kernel has tcx, else why not (BPF_PROG_QUERY of tcx ingress on lo)."""
    try:
        bpf.prog_query(1, bpf.BPF_TCX_INGRESS)
    except bpf.BpfError as err:
        return f"tcx: BPF_PROG_QUERY of tcx ingress on lo: {os.strerror(err.errno)} (tcx came in Linux 6.6)"
    return None


def rung(enable_tcx: bool = True) -> tuple[TcAttach, str]:
    """Which way the tc programs attach here, and why: tcx where the kernel has it, else (or with
    --enable-tcx=false) as cls_bpf filters of a clsact qdisc."""
    if not enable_tcx:
        return "clsact", "clsact + cls_bpf (--enable-tcx=false)"
    missing = tcx_available()
    if missing is None:
        return "tcx", "tcx"
    return "clsact", f"clsact + cls_bpf ({missing})"


def netlink(fn: Callable[[Any], T]) -> T:
    """fn(IPRoute) in a thread of its own, in this thread's network namespace."""
    def run() -> T:
        from pyroute2 import IPRoute

        loop = asyncio.SelectorEventLoop()  # pyroute2 does not close a loop it was given
        try:
            with IPRoute(use_event_loop=loop) as ipr:
                return fn(ipr)
        finally:
            loop.run_until_complete(asyncio.sleep(0))  # the socket's transport finishes closing
            loop.close()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def attach(ipr: Any, ifindex: int, prog: str, prog_fd: int) -> bool:
    """Our filter for `prog` on `ifindex` running `prog_fd` (added, or its program replaced);
    True when this call added the clsact qdisc. Raises BpfError."""
    added = ensure_clsact(ipr, ifindex)
    parent = PARENTS[prog]
    there = ours_or_foreign(ipr, ifindex, parent)
    if there is not None and there.name != prog:
        raise bpf.BpfError(f"ifindex {ifindex}: the tc filter at priority {PRIORITY} handle {HANDLE} is another "
                           f"program's ({there.name or 'unnamed'})", errno.EBUSY)
    _call(lambda: ipr.tc("replace-filter", "bpf", ifindex, HANDLE, fd=prog_fd, name=prog, parent=parent,
                         prio=PRIORITY, direct_action=True), f"cls_bpf {prog} on ifindex {ifindex}")
    return added


def detach(ipr: Any, ifindex: int, prog: str, prog_id: int | None = None) -> bool:
    """Delete our filter for `prog` on `ifindex` (with `prog_id`: only while it runs that
    program); False when it is not there (or the interface is gone, or another program's filter
    holds the place)."""
    there = ours_or_foreign(ipr, ifindex, PARENTS[prog])
    if there is None or there.name != prog:
        return False
    if prog_id is not None and there.prog_id is not None and there.prog_id != prog_id:
        return False
    _call(lambda: ipr.tc("del-filter", "bpf", ifindex, HANDLE, parent=PARENTS[prog], prio=PRIORITY),
          f"delete cls_bpf {prog} on ifindex {ifindex}")
    return True


def remove_clsact_if_empty(ipr: Any, ifindex: int) -> bool:
    """Delete the clsact qdisc of `ifindex` when no filter is left at either parent; whether it went."""
    if not has_clsact(ipr, ifindex) or any(filters(ipr, ifindex, p) for p in PARENTS.values()):
        return False
    _call(lambda: ipr.tc("del", "clsact", ifindex), f"delete clsact on ifindex {ifindex}")
    return True


def ensure_clsact(ipr: Any, ifindex: int) -> bool:
    """A clsact qdisc on `ifindex`; True when this call added it. An ingress qdisc (no egress
    hook) is refused: BpfError EEXIST."""
    kinds = qdisc_kinds(ipr, ifindex)
    if "clsact" in kinds:
        return False
    if "ingress" in kinds:
        raise bpf.BpfError(f"ifindex {ifindex} has an ingress qdisc, not clsact: no egress hook", errno.EEXIST)
    _call(lambda: ipr.tc("add", "clsact", ifindex), f"add clsact on ifindex {ifindex}")
    return True


def has_clsact(ipr: Any, ifindex: int) -> bool:
    return "clsact" in qdisc_kinds(ipr, ifindex)


def qdisc_kinds(ipr: Any, ifindex: int) -> list[str]:
    try:
        return [str(q.get_attr("TCA_KIND")) for q in ipr.get_qdiscs(ifindex)]
    except Exception as err:  # noqa: BLE001 - pyroute2 raises NetlinkError; ENODEV: no such interface
        raise _error(err, f"qdiscs of ifindex {ifindex}") from None


def filters(ipr: Any, ifindex: int, parent: int) -> list[Filter]:
    """Every filter at `parent` of `ifindex` (bpf ones with their name and program id)."""
    try:
        msgs = ipr.get_filters(ifindex, parent=parent)
    except Exception as err:  # noqa: BLE001 - as above
        if getattr(err, "code", 0) in (errno.ENODEV, errno.EINVAL, errno.ENOENT):
            return []  # no interface, or no clsact: no filters
        raise _error(err, f"filters of ifindex {ifindex}") from None
    out = []
    for m in msgs:
        opts = m.get_attr("TCA_OPTIONS")
        if opts is None:  # the priority's own header message
            continue
        name = opts.get_attr("TCA_BPF_NAME") if m.get_attr("TCA_KIND") == "bpf" else None
        out.append(Filter(parent, m["info"] >> 16, m["handle"], str(name or ""), _prog_id(opts)))
    return out


def ours_or_foreign(ipr: Any, ifindex: int, parent: int) -> Filter | None:
    """The filter at our priority and handle at `parent`, whoever's it is."""
    return next((f for f in filters(ipr, ifindex, parent) if f.priority == PRIORITY and f.handle == HANDLE), None)


def _prog_id(opts: Any) -> int | None:
    """TCA_BPF_ID from the raw attribute bytes (pyroute2 0.9.7 leaves it undecoded)."""
    try:
        raw = bytes(opts.data[opts.offset + 4: opts.offset + opts.length])
    except (AttributeError, TypeError):
        return None
    i = 0
    while i + 4 <= len(raw):
        length, kind = struct.unpack_from("=HH", raw, i)
        if length < 4:
            return None
        if kind & 0x3FFF == TCA_BPF_ID and length >= 8:
            return int(struct.unpack_from("=I", raw, i + 4)[0])
        i += (length + 3) & ~3
    return None


def _call(fn: Callable[[], Any], what: str) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - pyroute2's NetlinkError carries the errno in .code
        raise _error(err, what) from None


def _error(err: Exception, what: str) -> bpf.BpfError:
    code = int(getattr(err, "code", 0) or errno.EIO)
    return bpf.BpfError(f"{what}: {os.strerror(code)}", code)
