"""The socket LB in the kernel: load the object, attach it to a cgroup, pin maps and links.

Pins live under `<pin_root>/v<LAYOUT_VERSION>/` on bpffs: `maps/<map>` and `links/<program>`.
Because the links are pinned, programs stay attached and maps keep their contents when the agent
exits; an agent restart reuses the pinned maps (the new programs are loaded against them) and swaps
each pinned link to its new program with BPF_LINK_UPDATE, so there is no moment without a program
(field case C20). `remove()` detaches and unpins everything (`usproxy run --cleanup`).

Links are attached with BPF_LINK_CREATE in multi-attach mode: programs of others on the same cgroup
stay, as Cilium's socket LB coexists with other cgroup programs (bpf/bpf_sock.c hooks).

The tc NodePort programs (TC_PROGRAMS) come from the same object and share its maps. When asked for
(a tuple of interface indexes), each is attached to every interface on the rung the datapath
probed (`tc_attach`): with tcx (BPF_TCX_INGRESS/EGRESS links, kernel 6.6+), pinned as
`links/<program>@<ifindex>` and swapped on restart like the cgroup links; or, where tcx is
missing, as a cls_bpf filter of a clsact qdisc (cls_bpf.py), the program pinned as
`tc/<program>@<ifindex>` (and `tc/clsact@<ifindex>` marking a qdisc this module added), its
filter's program replaced in place on restart. Links and filters of interfaces no longer asked
for, or of the other rung, are removed after the new ones are in place. When not asked for, the
tc programs are not even loaded (a verifier that refuses them cannot cost the socket LB) and any
tc link or filter a previous agent left is removed.

Map sizes (`sizes`, map_sizes.py) are set before load. A pinned map of the size asked for is
reused; one of another size is replaced by a new map its entries are carried into across the
swap of the programs (map_resize.py), unless it holds more than the new size can (kept, logged)
or it is a table the programs being loaded never use (kept as it is).

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usproxy.offload.bpf import cls_bpf
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.build import object_path
from usproxy.offload.bpf.layout import LAYOUT_VERSION
from usproxy.offload.bpf.map_resize import Resize
from usproxy.offload.bpf.map_sizes import ENTRY_BYTES, UNUSED
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
TcAttach = cls_bpf.TcAttach  # how the tc programs attach: the rung the datapath probed
XDP_PROGRAM = "usp_xdp"
MAPS = ("usp_xdp_stats", "usp_ct", "usp_ct_any", "usp_ct_new", "usp_frags", "usp_tc_addrs", "usp_tc_ifaces",
        "usp_tc_sources", "usp_dsr_peers", "usp_services", "usp_slots", "usp_backends", "usp_backend_ids",
        "usp_affinity", "usp_revnat", "usp_flows", "usp_maglev", "usp_names")


def probe_tc_attach(ifindex: int, how: TcAttach = "tcx") -> None:
    """Load the object (the verifier judges every program, its maps at one entry: a probe costs no
    memory) and attach usp_tc_ingress to `ifindex` with tcx, or as a cls_bpf filter of a clsact
    qdisc, then remove it again; nothing is pinned. Raises BpfError or OffloadError with the
    reason (e.g. EINVAL for tcx before Linux 6.6)."""
    obj = bpf.BpfObject(str(object_path()))
    try:
        shrink_for_probe(obj)
        obj.set_autoload(XDP_PROGRAM, False)  # XDP has a probe of its own (xdp.py)
        obj.load()
        fd = obj.prog_fd("usp_tc_ingress")
        if how == "clsact":
            cls_bpf.netlink(lambda ipr: _probe_cls(ipr, ifindex, fd))
            return
        link = bpf.link_create(fd, ifindex, TC_PROGRAMS["usp_tc_ingress"])
        try:
            bpf.link_detach(link)
        finally:
            os.close(link)
    finally:
        obj.close()


def _probe_cls(ipr: Any, ifindex: int, fd: int) -> None:
    added = cls_bpf.attach(ipr, ifindex, "usp_tc_ingress", fd)
    cls_bpf.detach(ipr, ifindex, "usp_tc_ingress")
    if added:
        cls_bpf.remove_clsact_if_empty(ipr, ifindex)


def shrink_for_probe(obj: bpf.BpfObject) -> None:
    """Before a load that only asks the verifier: every sized map at one entry (a full-size load
    preallocates about 200 MiB: map_sizes.py)."""
    for name in obj.map_names():
        if name in ENTRY_BYTES:
            obj.set_max_entries(name, 1)


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

    @property
    def tc(self) -> Path:
        """Programs of cls_bpf filters (`<program>@<ifindex>`) and markers of clsact qdiscs added."""
        return self.base / "tc"

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
                 xdp_ifindexes: tuple[int, ...] | None = None, *, sizes: Mapping[str, int] | None = None,
                 tc_attach: TcAttach = "tcx") -> None:
        self.pins = pins
        self.cgroup = cgroup
        self.tc_ifindexes = tc_ifindexes
        self.xdp_ifindexes = xdp_ifindexes
        self.sizes = dict(sizes or {})  # map -> entries; maps not named keep sock_lb.c's size
        self.tc_attach: TcAttach = tc_attach
        self.xdp_attached: list[int] = []  # ifindexes running the XDP program after open()
        self.xdp_refused: dict[int, str] = {}  # ifindex -> why it does not
        self.maps: dict[str, int] = {}
        self.reused = False  # maps came from pins (an agent restart), not created empty
        self.resized: dict[str, tuple[int, int]] = {}  # map -> (entries before, after), carried over
        self.kept: dict[str, str] = {}  # map -> why its pinned size stayed although another was asked

    def open(self) -> None:
        """Load programs against the pinned maps (creating and pinning missing ones, replacing
        those of another size), then attach or swap every link. Raises BpfError; on failure
        nothing attached before is detached."""
        if self.pins.root.is_relative_to(BPFFS):
            ensure_bpffs(BPFFS)
        for d in (self.pins.maps, self.pins.links, self.pins.tc):
            d.mkdir(parents=True, exist_ok=True)
        obj = bpf.BpfObject(str(object_path()))
        resizes: list[Resize] = []
        try:
            resizes = self._reuse_maps(obj)
            for prog in TC_PROGRAMS:
                obj.set_autoload(prog, self.tc_ifindexes is not None)
            obj.set_autoload(XDP_PROGRAM, self.xdp_ifindexes is not None)
            obj.load()
            self._pin_new_maps(obj, resizes)
            for r in resizes:  # before the swap: the new programs start with every entry
                r.copy(obj.map_fd(r.name))
            self._attach_all(obj)
            self._attach_tc(obj)
            self._attach_xdp(obj)
            for r in resizes:  # after it: what the old programs wrote meanwhile, then the pin
                r.merge(obj.map_fd(r.name))
                os.rename(_resize_pin(self.pins, r.name), self.pins.maps / r.name)
                self.resized[r.name] = (r.old_entries, r.new_entries)
        finally:
            for r in resizes:
                os.close(r.old_fd)
                with contextlib.suppress(FileNotFoundError):
                    _resize_pin(self.pins, r.name).unlink()
            obj.close()
        self.maps = {name: bpf.obj_get(str(self.pins.maps / name)) for name in MAPS}
        for name, (before, after) in self.resized.items():
            log.warning("bpf: %s resized from %d to %d entries, its entries carried over", name, before, after)

    def _reuse_maps(self, obj: bpf.BpfObject) -> list[Resize]:
        """Reuse the pinned maps, size the new ones; the pinned maps to replace by a new size."""
        resizes = []
        for name in obj.map_names():
            with _fd(self.pins.maps / name) as fd:
                want = self.sizes.get(name)
                if fd is None:
                    if want is not None:
                        obj.set_max_entries(name, want)
                    continue
                self.reused = True
                resize = self._resize(name, fd, want)
                if resize is None:
                    obj.reuse_map(name, fd)
                    continue
                obj.set_max_entries(name, want or 1)
                resizes.append(resize)
        return resizes

    def _resize(self, name: str, fd: int, want: int | None) -> Resize | None:
        """A Resize when the pinned map `fd` must give way to one of `want` entries, else None."""
        have = int(bpf.fdinfo(fd)["max_entries"])
        if want is None or want == have:
            return None
        if want == UNUSED:  # a table the programs loaded now never use: not worth a new map
            self.kept[name] = f"{have} entries kept: unused without the tc programs"
            return None
        resize = Resize.of(name, os.dup(fd), want)
        if not resize.fits():
            os.close(resize.old_fd)
            self.kept[name] = f"{have} entries kept: it holds more than {want}"
            log.warning("bpf: %s keeps its %d entries: it holds more than the %d asked for", name, have, want)
            return None
        return resize

    def _pin_new_maps(self, obj: bpf.BpfObject, resizes: list[Resize]) -> None:
        replacing = {r.name for r in resizes}
        for name in obj.map_names():
            path = _resize_pin(self.pins, name) if name in replacing else self.pins.maps / name
            if name in replacing:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # one a crashed resize left
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
        """The tc programs on every interface asked for, on the probed rung; then what is no longer
        asked for (another interface, the other rung, XDP elsewhere) goes: make before break."""
        wanted = set(self.tc_ifindexes or ())
        tcx = self.tc_attach == "tcx"
        if tcx:
            for prog, attach_type in TC_PROGRAMS.items():
                for ifindex in sorted(wanted):
                    fd = obj.prog_fd(prog)
                    self._attach_at(fd, prog, ifindex, lambda: bpf.link_create(fd, ifindex, attach_type))
        elif wanted:
            self._attach_cls({prog: obj.prog_fd(prog) for prog in TC_PROGRAMS}, sorted(wanted))
        for path in sorted(self.pins.links.glob("*@*")):
            prog, _, at = path.name.rpartition("@")
            keep = int(at) in set(self.xdp_ifindexes or ()) if prog == XDP_PROGRAM else tcx and int(at) in wanted
            if not keep:
                _remove_links_at([path])
        _remove_cls_at(self.pins.tc, [p for p in _cls_pins(self.pins.tc) if tcx or _at(p) not in wanted])

    def _attach_cls(self, fds: dict[str, int], ifindexes: list[int]) -> None:
        """cls_bpf filters for the tc programs on `ifindexes` (cls_bpf.py), each program pinned as
        tc/<program>@<ifindex>, a clsact this call added marked by tc/clsact@<ifindex>."""
        def attach(ipr: Any) -> list[int]:
            added = []
            for ifindex in ifindexes:
                for prog, fd in fds.items():
                    if cls_bpf.attach(ipr, ifindex, prog, fd):
                        added.append(ifindex)
            return added
        for ifindex in cls_bpf.netlink(attach):
            (self.pins.tc / f"clsact@{ifindex}").mkdir(exist_ok=True)
        for ifindex in ifindexes:
            for prog, fd in fds.items():
                _repin(fd, self.pins.tc / f"{prog}@{ifindex}")

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

    def memlock(self) -> int:
        """Bytes the kernel charges for the maps (fdinfo memlock: exact from Linux 6.4 on, key
        and value bytes alone before)."""
        return sum(int(bpf.fdinfo(fd).get("memlock", "0")) for fd in self.maps.values())

    def close(self) -> None:
        """Close this process's fds; pins keep programs attached and maps filled."""
        for fd in self.maps.values():
            os.close(fd)
        self.maps.clear()


def _resize_pin(pins: PinLayout, name: str) -> Path:
    """Where a map replacing a pinned one of another size waits before it takes its place (bpffs
    refuses names with a dot)."""
    return pins.maps / f"resized~{name}"


def _repin(fd: int, path: Path) -> None:
    """Pin `fd` at `path`, replacing what is pinned there without a moment without a pin."""
    tmp = path.with_name("new~" + path.name)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    bpf.obj_pin(fd, str(tmp))
    os.rename(tmp, path)


def _cls_pins(tc: Path) -> list[Path]:
    """The pinned programs of cls_bpf filters under `tc`."""
    return sorted(p for p in tc.glob("*@*") if p.name.partition("@")[0] in TC_PROGRAMS) if tc.is_dir() else []


def _at(path: Path) -> int:
    return int(path.name.rpartition("@")[2])


def _remove_cls_at(tc: Path, paths: list[Path]) -> list[str]:
    """Delete the cls_bpf filters whose programs are pinned at `paths` (only a filter at our place
    running that very program), then the clsact qdiscs we added that are left empty, and unpin."""
    if not paths:
        return []
    ids = {}
    for path in paths:
        with _fd(path) as fd:
            ids[path] = int(bpf.fdinfo(fd)["prog_id"]) if fd is not None else None
    markers = {_at(p): tc / f"clsact@{_at(p)}" for p in paths}
    staying = {_at(p) for p in _cls_pins(tc) if p not in ids}

    def detach(ipr: Any) -> list[int]:
        found = set()  # interfaces where our filters were: this is their network namespace
        for path, prog_id in ids.items():
            if cls_bpf.detach(ipr, _at(path), path.name.partition("@")[0], prog_id):
                found.add(_at(path))
        return [i for i in sorted(found) if i not in staying and markers[i].is_dir()
                and cls_bpf.remove_clsact_if_empty(ipr, i)]
    try:
        emptied = cls_bpf.netlink(detach)
    except bpf.BpfError as err:  # the pins go anyway; the filters stay until their interface does
        log.warning("bpf: removing tc filters: %s", err)
        emptied = []
    removed = []
    for path in paths:
        path.unlink()
        removed.append(f"tc filter {path.name}")
    for ifindex in emptied:
        markers[ifindex].rmdir()
        removed.append(f"clsact qdisc on ifindex {ifindex}")
    return removed


def attached_links(pins: PinLayout) -> dict[str, dict[str, str]]:
    """fdinfo of every pinned link (program name -> link_type, prog_id, cgroup_id, ...), and of
    every program pinned for a cls_bpf filter (link_type "cls_bpf", prog_id, ifindex)."""
    out: dict[str, dict[str, str]] = {}
    if pins.links.is_dir():
        for path in sorted(pins.links.iterdir()):
            with _fd(path) as fd:
                if fd is not None:
                    out[path.name] = bpf.fdinfo(fd)
    for path in _cls_pins(pins.tc):
        with _fd(path) as fd:
            if fd is not None:
                out[path.name] = {"link_type": "cls_bpf", "prog_id": bpf.fdinfo(fd)["prog_id"], "ifindex": str(_at(path))}
    return out


def remove(pins: PinLayout) -> list[str]:
    """Detach every pinned link and remove every pin of `pins.root`; what was removed."""
    removed: list[str] = []
    if not pins.root.exists():
        return removed
    for base in sorted(p for p in pins.root.iterdir() if p.is_dir()):  # every layout version
        removed += _remove_links(base / "links") + _remove_cls_at(base / "tc", _cls_pins(base / "tc"))
        removed += _remove_tree(base)
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
