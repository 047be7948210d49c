"""`--live`: this node's real state, read (never changed) from a running agent and the kernel.

Reads GET http://<metrics address>/services and /flows (JSON, see usproxy/util/table.py), every
usproxy nftables table that exists (`nft list table ip usproxy`, then `ip6`: the offload keeps one
table per IP family, usproxy/offload/nftables) and the pinned BPF maps. Best effort: each source
that cannot be read is reported as such; `read_live` returns None only when nothing at all could
be read, so the command can exit 1 with a clear message.

Kernel state (the nftables tables, the BPF pins) outlives its agent on purpose (an agent restart
adopts it, field case C20), so it is marked with its owner: the pid holding this network
namespace's offload lock (usproxy/util/locks.py NetnsLock, found in /proc/locks without taking it,
so an agent starting meanwhile is never refused), or "orphaned" when no running agent holds it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from usproxy.model.types import FAMILIES
from usproxy.offload.nftables.names import TABLE, nft_family
from usproxy.util.table import render_flows, render_services

TIMEOUT = 3.0


def _get(addr: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=TIMEOUT) as resp:
        return json.load(resp)


def nft_tables() -> list[tuple[str, str]]:
    """(family, `nft list table <family> usproxy` text) of every usproxy table that exists."""
    nft = shutil.which("nft")
    if nft is None:
        return []
    out = []
    for family in map(nft_family, FAMILIES):
        try:
            done = subprocess.run([nft, "list", "table", family, TABLE], capture_output=True,
                                  text=True, timeout=TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            out.append((family, done.stdout))
    return out


def offload_owner(proc_locks: Path = Path("/proc/locks")) -> int | None:
    """The pid of the agent holding this network namespace's offload lock, or None (no lock
    file, or nobody holds it). `/proc/locks` lines read "1: FLOCK ADVISORY WRITE <pid>
    <major>:<minor>:<inode> 0 EOF" (device numbers in hex, as the kernel's fs/locks.c prints)."""
    from usproxy.util.locks import NetnsLock

    try:
        st = os.stat(NetnsLock("offload").path)
        lines = proc_locks.read_text().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if "->" not in fields and "FLOCK" in fields and fields[-3] == inode:
            return int(fields[-4])
    return None


def ownership(owner: int | None) -> str:
    """How kernel state is marked: its agent, or orphaned with what to do about it."""
    if owner is not None:
        return f"owned by the running agent, pid {owner}"
    return ("ORPHANED: no running usproxy agent holds this network namespace's offload lock; left by "
            "an earlier run, still in effect (BPF pins keep their programs attached); the next agent adopts it, "
            "`usproxy run --cleanup` removes it")


def read_live(addr: str, pin_root: Path | None = None) -> str | None:
    """The live view, or None when neither the agent nor the kernel table could be read.
    `pin_root`: where BPF pins are read (None: USPROXY_BPF_PINS, else /sys/fs/bpf/usproxy)."""
    parts, got = [], False
    for path, render in (("/services", render_services), ("/flows", render_flows)):
        try:
            rows = _get(addr, path)
            parts.append(f"# live {path} from http://{addr}\n{render(rows)}\n")
            got = True
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
            parts.append(f"# live {path}: not available from http://{addr} ({err})\n")
    kernel_at = len(parts)  # the ownership line goes before the kernel state it marks
    tables = nft_tables()
    for family, text in tables:
        parts.append(f"# live: nft list table {family} {TABLE}\n{text}")
    if tables:
        got = True
    else:
        parts.append("# live: no usproxy nftables table (or nft not installed / not permitted)\n")
    try:
        from usproxy.offload.bpf.view import render_pinned

        pinned = render_pinned(pin_root)
    except Exception as err:  # no bpffs, no permission, an older pin layout: say so
        parts.append(f"# live bpf: cannot read pins ({err})\n")
        pinned = None
    if pinned is not None:
        parts.append(pinned + "\n")
        got = True
    kernel = [f"nft table {family} {TABLE}" for family, _ in tables] + (["bpf pins"] if pinned else [])
    if kernel:
        parts.insert(kernel_at, f"# live kernel state ({', '.join(kernel)}): {ownership(offload_owner())}\n")
    return "\n".join(parts) if got else None
