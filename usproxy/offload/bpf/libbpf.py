"""A small ctypes binding over libbpf.so.1: what the socket-LB datapath needs, nothing more.

Kernel and libbpf names are kept verbatim (`BPF_CGROUP_INET4_CONNECT`, `bpf_link_create`), as
pyroute2 does for netlink. libbpf 1.x returns -errno from its low-level calls and NULL (with errno
set) from its object calls; both become `BpfError`, an OffloadError carrying the errno. bcc and
pylibbpf do not work on this project's machines (docs/platform.md#bpf); this binding does.

Every file descriptor handed out here is owned by the caller (close it with os.close), except
those owned by a `BpfObject` (map and program fds), which live until `BpfObject.close()`.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

from usproxy.util.errors import OffloadError

log = logging.getLogger(__name__)

# enum bpf_map_type (include/uapi/linux/bpf.h)
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_LRU_HASH = 9
BPF_MAP_TYPE_HASH_OF_MAPS = 13

# enum bpf_attach_type
BPF_CGROUP_INET4_CONNECT = 10
BPF_CGROUP_INET6_CONNECT = 11
BPF_CGROUP_UDP4_SENDMSG = 14
BPF_CGROUP_UDP6_SENDMSG = 15
BPF_CGROUP_UDP4_RECVMSG = 19
BPF_CGROUP_UDP6_RECVMSG = 20
BPF_CGROUP_INET4_GETPEERNAME = 29
BPF_CGROUP_INET6_GETPEERNAME = 30
BPF_CGROUP_INET_SOCK_RELEASE = 34
BPF_TCX_INGRESS = 46  # kernel 6.6+; newer than this machine's uapi headers
BPF_TCX_EGRESS = 47
BPF_XDP = 37
XDP_FLAGS_DRV_MODE = 1 << 2  # native XDP only: refused (EOPNOTSUPP) where the driver has none

BPF_ANY = 0
BPF_NOEXIST = 1

LIBRARY = "libbpf.so.1"


class BpfError(OffloadError):
    """A libbpf or bpf(2) call failed; `errno` is the kernel's."""


@functools.cache
def lib() -> ctypes.CDLL:
    """libbpf.so.1 with argument types declared. Raises BpfError when it cannot be loaded."""
    try:
        so = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as err:
        raise BpfError(f"cannot load {LIBRARY}: {err}", errno.ENOENT) from None
    _declare(so)
    return so


def _declare(so: ctypes.CDLL) -> None:
    p, i, u32, u64, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_char_p
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "libbpf_set_print": (p, [_PRINT_FN]),
        "bpf_object__open_file": (p, [s, p]),
        "bpf_object__load": (i, [p]),
        "bpf_object__close": (None, [p]),
        "bpf_object__next_map": (p, [p, p]),
        "bpf_object__find_program_by_name": (p, [p, s]),
        "bpf_map__name": (s, [p]),
        "bpf_map__fd": (i, [p]),
        "bpf_map__reuse_fd": (i, [p, i]),
        "bpf_map__set_max_entries": (i, [p, u32]),
        "bpf_map__max_entries": (u32, [p]),
        "bpf_program__fd": (i, [p]),
        "bpf_program__set_autoload": (i, [p, ctypes.c_bool]),
        "bpf_map_create": (i, [i, s, u32, u32, u32, p]),
        "bpf_map_update_elem": (i, [i, p, p, u64]),
        "bpf_map_lookup_elem": (i, [i, p, p]),
        "bpf_map_delete_elem": (i, [i, p]),
        "bpf_map_get_next_key": (i, [i, p, p]),
        "bpf_obj_pin": (i, [i, s]),
        "bpf_obj_get": (i, [s]),
        "bpf_map_get_fd_by_id": (i, [u32]),
        "bpf_link_create": (i, [i, i, i, p]),
        "bpf_link_update": (i, [i, i, p]),
        "bpf_link_detach": (i, [i]),
        "bpf_prog_query": (i, [i, i, u32, p, p, p]),
        "libbpf_num_possible_cpus": (i, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = res, args
    so.libbpf_set_print(_PRINT)  # libbpf's messages go to logging, and into load errors


_LOG: collections.deque[str] = collections.deque(maxlen=200)
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _print(level: int, fmt: bytes, args: int) -> int:
    """libbpf's log callback: format with vsnprintf and keep the lines (verifier output)."""
    buf = ctypes.create_string_buffer(4096)
    _libc().vsnprintf(buf, len(buf), fmt, args)
    for line in buf.value.decode(errors="replace").splitlines():
        _LOG.append(line)
        log.debug("libbpf: %s", line)
    return 0


_PRINT = _PRINT_FN(_print)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
    return libc


def recent_log(lines: int = 20) -> str:
    """The last lines libbpf logged (why an open or load failed)."""
    return "\n".join(list(_LOG)[-lines:])


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = -ret if ret != -1 else ctypes.get_errno() or errno.EIO
        raise BpfError(f"{what}: {os.strerror(err)}", err)
    return ret


def _null(ptr: int | None, what: str) -> int:
    if not ptr:
        err = ctypes.get_errno() or errno.EIO
        raise BpfError(f"{what}: {os.strerror(err)}; libbpf said: {recent_log(5)}", err)
    return ptr


# -- bpf(2) on file descriptors ----------------------------------------------------------------

def map_create(map_type: int, name: str, key_size: int, value_size: int, max_entries: int) -> int:
    """A new map fd (BPF_MAP_CREATE)."""
    return _check(lib().bpf_map_create(map_type, name.encode(), key_size, value_size, max_entries, None),
                  f"bpf_map_create {name}")


def map_update(fd: int, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
    _check(lib().bpf_map_update_elem(fd, key, value, flags), "bpf_map_update_elem")


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value under `key`, or None when there is none."""
    buf = ctypes.create_string_buffer(value_size)
    ret = lib().bpf_map_lookup_elem(fd, key, buf)
    if ret == -errno.ENOENT:
        return None
    _check(ret, "bpf_map_lookup_elem")
    return buf.raw


def map_delete(fd: int, key: bytes) -> bool:
    """Delete `key`; False when it was not there."""
    ret = lib().bpf_map_delete_elem(fd, key)
    if ret == -errno.ENOENT:
        return False
    _check(ret, "bpf_map_delete_elem")
    return True


def map_keys(fd: int, key_size: int) -> Iterator[bytes]:
    """Every key (BPF_MAP_GET_NEXT_KEY). Keys deleted meanwhile may restart the walk: callers
    that delete while walking collect the keys first."""
    prev: bytes | None = None
    nxt = ctypes.create_string_buffer(key_size)
    while True:
        ret = lib().bpf_map_get_next_key(fd, prev, nxt)
        if ret == -errno.ENOENT:
            return
        _check(ret, "bpf_map_get_next_key")
        prev = nxt.raw
        yield prev


def map_items(fd: int, key_size: int, value_size: int) -> list[tuple[bytes, bytes]]:
    """Every (key, value) present now."""
    out = []
    for key in list(map_keys(fd, key_size)):
        value = map_lookup(fd, key, value_size)
        if value is not None:
            out.append((key, value))
    return out


def map_get_fd_by_id(map_id: int) -> int:
    """An fd for a map by id (the inner maps of a map-of-maps are looked up as ids)."""
    return _check(lib().bpf_map_get_fd_by_id(map_id), f"bpf_map_get_fd_by_id {map_id}")


def obj_pin(fd: int, path: str) -> None:
    _check(lib().bpf_obj_pin(fd, path.encode()), f"bpf_obj_pin {path}")


def obj_get(path: str) -> int:
    """An fd for the object pinned at `path`. Raises BpfError (ENOENT when nothing is pinned)."""
    return _check(lib().bpf_obj_get(path.encode()), f"bpf_obj_get {path}")


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """A BPF link attaching `prog_fd` to a cgroup fd (multi-attach: others' programs stay) or,
    for BPF_TCX_*, to an interface by ifindex (appended after programs already there)."""
    return _check(lib().bpf_link_create(prog_fd, target_fd, attach_type, None), "bpf_link_create")


class _LinkCreateOpts(ctypes.Structure):
    """struct bpf_link_create_opts up to `flags`, zero-padded (libbpf accepts a larger struct
    whose unknown tail is zero)."""

    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("_tail", ctypes.c_uint8 * 64)]


def xdp_link_create(prog_fd: int, ifindex: int, flags: int = XDP_FLAGS_DRV_MODE) -> int:
    """A BPF link attaching an XDP program to interface `ifindex` (native mode by default).
    Raises BpfError: EOPNOTSUPP without native XDP, EBUSY when another XDP program is there."""
    opts = _LinkCreateOpts(ctypes.sizeof(_LinkCreateOpts), flags)
    return _check(lib().bpf_link_create(prog_fd, ifindex, BPF_XDP, ctypes.byref(opts)),
                  f"bpf_link_create xdp ifindex {ifindex}")


def possible_cpus() -> int:
    """How many CPUs a per-CPU map holds a value for."""
    return _check(lib().libbpf_num_possible_cpus(), "libbpf_num_possible_cpus")


def percpu_sum_u64(fd: int, key: bytes) -> int:
    """The sum over CPUs of a per-CPU array's u64 under `key` (0 when absent)."""
    raw = map_lookup(fd, key, 8 * possible_cpus())
    return sum(int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)) if raw else 0


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the program behind a link atomically (no moment without a program)."""
    _check(lib().bpf_link_update(link_fd, prog_fd, None), "bpf_link_update")


def link_detach(link_fd: int) -> None:
    """Detach a link's program now, whoever else holds the link (BPF_LINK_DETACH)."""
    _check(lib().bpf_link_detach(link_fd), "bpf_link_detach")


def prog_query(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached to a cgroup for one attach type."""
    ids = (ctypes.c_uint32 * 64)()
    count = ctypes.c_uint32(64)
    flags = ctypes.c_uint32(0)
    _check(lib().bpf_prog_query(cgroup_fd, attach_type, 0, ctypes.byref(flags), ids,
                                ctypes.byref(count)), "bpf_prog_query")
    return list(ids[: count.value])


# -- libbpf objects ----------------------------------------------------------------------------

class BpfObject:
    """An ELF object opened (and later loaded) by libbpf: its maps and programs by name."""

    def __init__(self, path: str) -> None:
        self._obj: int | None = _null(lib().bpf_object__open_file(path.encode(), None),
                                      f"bpf_object__open_file {path}")
        self.path = path

    def _ptr(self) -> int:
        if self._obj is None:
            raise BpfError("BPF object already closed", errno.EBADF)
        return self._obj

    def _maps(self) -> dict[str, int]:
        out: dict[str, int] = {}
        m = lib().bpf_object__next_map(self._ptr(), None)
        while m:
            out[lib().bpf_map__name(m).decode()] = m
            m = lib().bpf_object__next_map(self._ptr(), m)
        return out

    def map_names(self) -> list[str]:
        return sorted(self._maps())

    def reuse_map(self, name: str, fd: int) -> None:
        """Before load: use an existing (pinned) map instead of creating `name`."""
        _check(lib().bpf_map__reuse_fd(self._maps()[name], fd), f"bpf_map__reuse_fd {name}")

    def set_max_entries(self, name: str, entries: int) -> None:
        """Before load: create map `name` with room for `entries` (usproxy/offload/bpf/map_sizes.py)."""
        _check(lib().bpf_map__set_max_entries(self._maps()[name], entries), f"bpf_map__set_max_entries {name}")

    def max_entries(self, name: str) -> int:
        """The entries map `name` is (or will be) created with."""
        return int(lib().bpf_map__max_entries(self._maps()[name]))

    def load(self) -> None:
        """Create maps, verify and load programs (BPF_PROG_LOAD). Raises BpfError."""
        _LOG.clear()
        ret = lib().bpf_object__load(self._ptr())
        if ret < 0:
            raise BpfError(f"bpf_object__load {self.path}: {os.strerror(-ret)}; libbpf said: "
                           f"{recent_log()}", -ret)

    def set_autoload(self, name: str, load: bool) -> None:
        """Before load: whether program `name` is loaded at all (its maps are created anyway)."""
        prog = _null(lib().bpf_object__find_program_by_name(self._ptr(), name.encode()),
                     f"no program {name}")
        _check(lib().bpf_program__set_autoload(prog, load), f"bpf_program__set_autoload {name}")

    def map_fd(self, name: str) -> int:
        return _check(lib().bpf_map__fd(self._maps()[name]), f"bpf_map__fd {name}")

    def prog_fd(self, name: str) -> int:
        prog = _null(lib().bpf_object__find_program_by_name(self._ptr(), name.encode()),
                     f"no program {name}")
        return _check(lib().bpf_program__fd(prog), f"bpf_program__fd {name}")

    def close(self) -> None:
        if self._obj is not None:
            lib().bpf_object__close(self._obj)
            self._obj = None


def fdinfo(fd: int) -> dict[str, str]:
    """/proc/self/fdinfo of a BPF fd: link_type, prog_id, attach_type, cgroup_id, map_type..."""
    out: dict[str, str] = {}
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    return out
