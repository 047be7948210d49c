"""The socket LB in the kernel: load the object, attach it to a cgroup, pin maps and links.

Pins live under `<pin_root>/v<LAYOUT_VERSION>/` on bpffs: `maps/<map>` and `links/<program>`.
Because the links are pinned, programs stay attached and maps keep their contents when the agent
exits; an agent restart reuses the pinned maps (the new programs are loaded against them) and swaps
each pinned link to its new program with BPF_LINK_UPDATE, so there is no moment without a program
(field case C20). `remove()` detaches and unpins everything (`usproxy run --cleanup`).

Links are attached with BPF_LINK_CREATE in multi-attach mode: programs of others on the same cgroup
stay, as Cilium's socket LB coexists with other cgroup programs (bpf/bpf_sock.c hooks).

The tc NodePort programs (TC_PROGRAMS) come from the same object and share its maps. When asked for
(a tuple of interface indexes), each is attached with tcx (BPF_TCX_INGRESS/EGRESS links, kernel
6.6+) to every interface and pinned as `links/<program>@<ifindex>`, swapped on restart like the
cgroup links; links of interfaces no longer asked for are detached. When not asked for, the tc
programs are not even loaded (a verifier that refuses them cannot cost the socket LB) and any tc
link a previous agent left is detached.

The XDP program (XDP_PROGRAM, --bpf-lb-acceleration native) is loaded only when asked for (a tuple
of interface indexes) and attached in native mode to each of them as `links/usp_xdp@<ifindex>`,
swapped on restart the same way. An interface that refuses it (no native XDP in its driver, or
another XDP program there) keeps the tc programs alone: `xdp_refused` says why, per interface.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.build import object_path
from usproxy.offload.bpf.layout import LAYOUT_VERSION
from usproxy.offload.pin_root import BPFFS as BPFFS  # re-exported: loader.BPFFS

log = logging.getLogger(__name__)


PROGRAMS: dict[str, int] = {
    "usp_connect4": bpf.BPF_CGROUP_INET4_CONNECT,
    "usp_connect6": bpf.BPF_CGROUP_INET6_CONNECT,
    "usp_sendmsg4": bpf.BPF_CGROUP_UDP4_SENDMSG,
    "usp_sendmsg6": bpf.BPF_CGROUP_UDP6_SENDMSG,
    "usp_recvmsg4": bpf.BPF_CGROUP_UDP4_RECVMSG,
    "usp_recvmsg6": bpf.BPF_CGROUP_UDP6_RECVMSG,
    "usp_getpeername4": bpf.BPF_CGROUP_INET4_GETPEERNAME,
    "usp_getpeername6": bpf.BPF_CGROUP_INET6_GETPEERNAME,
    "usp_sock_release": bpf.BPF_CGROUP_INET_SOCK_RELEASE,
}
TC_PROGRAMS: dict[str, int] = {
    "usp_tc_ingress": bpf.BPF_TCX_INGRESS,
    "usp_tc_egress": bpf.BPF_TCX_EGRESS,
}
XDP_PROGRAM = "usp_xdp"
MAPS = ("usp_xdp_stats", "usp_ct", "usp_ct_any", "usp_ct_new", "usp_frags", "usp_tc_addrs", "usp_tc_ifaces",
        "usp_tc_sources", "usp_dsr_peers", "usp_services", "usp_slots", "usp_backends", "usp_backend_ids",
        "usp_affinity", "usp_revnat", "usp_flows", "usp_maglev", "usp_names")


def probe_tc_attach(ifindex: int) -> None:
    """Load the object (the verifier judges every program) and attach usp_tc_ingress with tcx to
    `ifindex`, then detach it; nothing is pinned. Raises BpfError or OffloadError with the reason
    (e.g. EINVAL from a kernel before 6.6, which has no tcx)."""
    obj = bpf.BpfObject(str(object_path()))
    try:
        obj.load()
        link = bpf.link_create(obj.prog_fd("usp_tc_ingress"), ifindex, TC_PROGRAMS["usp_tc_ingress"])
        try:
            bpf.link_detach(link)
        finally:
            os.close(link)
    finally:
        obj.close()


# -- mounts ------------------------------------------------------------------------------------

def mount_type(path: Path) -> str | None:
    """The filesystem type of the mount that holds `path` (longest mount point prefix)."""
    best, fstype = "", None
    target = str(path.resolve()) if path.exists() else str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4].replace("\\040", " ")
            sep = fields.index("-")
            inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, fstype = mnt, fields[sep + 1]
    return fstype


def ensure_bpffs(where: Path = BPFFS) -> bool:
    """Mount bpffs at `where` if nothing is mounted there; True when this call mounted it."""
    if mount_type(where) == "bpf":
        return False
    where.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_void_p]
    if libc.mount(b"bpf", str(where).encode(), b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise bpf.BpfError(f"mount bpffs at {where}: {os.strerror(err)}", err)
    log.info("mounted bpffs at %s", where)
    return True


def cgroup_id(cgroup: Path) -> int:
    """The cgroup id the kernel reports in link fdinfo: the cgroup directory's inode."""
    return os.stat(cgroup).st_ino


# -- pins --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PinLayout:
    """Where one usproxy instance pins its objects."""

    root: Path

    @property
    def base(self) -> Path:
        return self.root / f"v{LAYOUT_VERSION}"

    @property
    def maps(self) -> Path:
        return self.base / "maps"

    @property
    def links(self) -> Path:
        return self.base / "links"

    def exists(self) -> bool:
        return self.maps.is_dir()


@contextlib.contextmanager
def _fd(path: Path) -> Iterator[int | None]:
    """An fd for a pinned object, or None when nothing is pinned there."""
    try:
        fd = bpf.obj_get(str(path))
    except bpf.BpfError as err:
        if err.errno == errno.ENOENT:
            yield None
            return
        raise
    try:
        yield fd
    finally:
        os.close(fd)


class SockLB:
    """The loaded socket LB of one pin layout: map fds by name; programs live in pinned links."""

    def __init__(self, pins: PinLayout, cgroup: Path, tc_ifindexes: tuple[int, ...] | None = None,
                 xdp_ifindexes: tuple[int, ...] | None = None) -> None:
        self.pins = pins
        self.cgroup = cgroup
        self.tc_ifindexes = tc_ifindexes
        self.xdp_ifindexes = xdp_ifindexes
        self.xdp_attached: list[int] = []  # ifindexes running the XDP program after open()
        self.xdp_refused: dict[int, str] = {}  # ifindex -> why it does not
        self.maps: dict[str, int] = {}
        self.reused = False  # maps came from pins (an agent restart), not created empty

    def open(self) -> None:
        """Load programs against the pinned maps (creating and pinning missing ones), then attach
        or swap every link. Raises BpfError; on failure nothing attached before is detached."""
        if self.pins.root.is_relative_to(BPFFS):
            ensure_bpffs(BPFFS)
        self.pins.maps.mkdir(parents=True, exist_ok=True)
        self.pins.links.mkdir(parents=True, exist_ok=True)
        obj = bpf.BpfObject(str(object_path()))
        try:
            self.reused = self._reuse_maps(obj)
            for prog in TC_PROGRAMS:
                obj.set_autoload(prog, self.tc_ifindexes is not None)
            obj.set_autoload(XDP_PROGRAM, self.xdp_ifindexes is not None)
            obj.load()
            self._pin_new_maps(obj)
            self._attach_all(obj)
            self._attach_tc(obj)
            self._attach_xdp(obj)
        finally:
            obj.close()
        self.maps = {name: bpf.obj_get(str(self.pins.maps / name)) for name in MAPS}

    def _reuse_maps(self, obj: bpf.BpfObject) -> bool:
        reused = False
        for name in obj.map_names():
            with _fd(self.pins.maps / name) as fd:
                if fd is not None:
                    obj.reuse_map(name, fd)
                    reused = True
        return reused

    def _pin_new_maps(self, obj: bpf.BpfObject) -> None:
        for name in obj.map_names():
            path = self.pins.maps / name
            if not path.exists():
                bpf.obj_pin(obj.map_fd(name), str(path))

    def _attach_all(self, obj: bpf.BpfObject) -> None:
        cg = os.open(self.cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for prog, attach_type in PROGRAMS.items():
                self._attach(obj.prog_fd(prog), prog, attach_type, cg)
        finally:
            os.close(cg)

    def _attach(self, prog_fd: int, prog: str, attach_type: int, cg: int) -> None:
        path = self.pins.links / prog
        with _fd(path) as old:
            if old is not None and int(bpf.fdinfo(old).get("cgroup_id", "0")) == cgroup_id(self.cgroup):
                bpf.link_update(old, prog_fd)
                return
            new = bpf.link_create(prog_fd, cg, attach_type)
            try:
                if old is not None:  # the cgroup changed: the new link first, then the old goes
                    bpf.link_detach(old)
                    path.unlink()
                bpf.obj_pin(new, str(path))
            finally:
                os.close(new)

    def _attach_tc(self, obj: bpf.BpfObject) -> None:
        wanted = set(self.tc_ifindexes or ())
        for path in sorted(self.pins.links.glob("*@*")):
            prog, _, at = path.name.rpartition("@")
            if int(at) not in (set(self.xdp_ifindexes or ()) if prog == XDP_PROGRAM else wanted):
                _remove_links_at([path])
        for prog, attach_type in TC_PROGRAMS.items():
            for ifindex in sorted(wanted):
                fd = obj.prog_fd(prog)
                self._attach_at(fd, prog, ifindex, lambda: bpf.link_create(fd, ifindex, attach_type))

    def _attach_at(self, prog_fd: int, prog: str, ifindex: int, create: Callable[[], int]) -> None:
        """The link of `prog` on interface `ifindex`, pinned as links/<prog>@<ifindex>: a link
        already pinned there gets the new program (BPF_LINK_UPDATE, no moment without one); a
        defunct one (its interface went away) is replaced by `create()`'s, as is a missing one."""
        path = self.pins.links / f"{prog}@{ifindex}"
        with _fd(path) as old:
            if old is not None and int(bpf.fdinfo(old).get("ifindex", "0")) == ifindex:
                bpf.link_update(old, prog_fd)
                return
            if old is not None:
                path.unlink()
            new = create()
            try:
                bpf.obj_pin(new, str(path))
            finally:
                os.close(new)

    def _attach_xdp(self, obj: bpf.BpfObject) -> None:
        self.xdp_attached, self.xdp_refused = [], {}
        for ifindex in sorted(set(self.xdp_ifindexes or ())):
            fd = obj.prog_fd(XDP_PROGRAM)
            try:
                self._attach_at(fd, XDP_PROGRAM, ifindex, lambda: bpf.xdp_link_create(fd, ifindex))
                self.xdp_attached.append(ifindex)
            except bpf.BpfError as err:
                self.xdp_refused[ifindex] = os.strerror(err.errno) if err.errno else str(err)
                log.warning("bpf: no native XDP on ifindex %d (%s): tc serves it", ifindex, err)

    def close(self) -> None:
        """Close this process's fds; pins keep programs attached and maps filled."""
        for fd in self.maps.values():
            os.close(fd)
        self.maps.clear()


def attached_links(pins: PinLayout) -> dict[str, dict[str, str]]:
    """fdinfo of every pinned link (program name -> link_type, prog_id, cgroup_id, ...)."""
    out: dict[str, dict[str, str]] = {}
    if not pins.links.is_dir():
        return out
    for path in sorted(pins.links.iterdir()):
        with _fd(path) as fd:
            if fd is not None:
                out[path.name] = bpf.fdinfo(fd)
    return out


def remove(pins: PinLayout) -> list[str]:
    """Detach every pinned link and remove every pin of `pins.root`; what was removed."""
    removed: list[str] = []
    if not pins.root.exists():
        return removed
    for base in sorted(p for p in pins.root.iterdir() if p.is_dir()):  # every layout version
        removed += _remove_links(base / "links") + _remove_tree(base)
    with contextlib.suppress(OSError):
        pins.root.rmdir()
    return removed


def _remove_links(links: Path) -> list[str]:
    return _remove_links_at(sorted(links.iterdir())) if links.is_dir() else []


def _remove_links_at(paths: list[Path]) -> list[str]:
    """Detach the links pinned at `paths` and unpin them."""
    removed = []
    for path in paths:
        with _fd(path) as fd:
            if fd is not None:
                with contextlib.suppress(bpf.BpfError):
                    bpf.link_detach(fd)
        path.unlink()
        removed.append(f"link {path.name}")
    return removed


def _remove_tree(base: Path) -> list[str]:
    removed = []
    for path in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()
            removed.append(f"map {path.name}")
    base.rmdir()
    return removed
