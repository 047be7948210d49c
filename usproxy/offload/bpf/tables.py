"""The socket LB's maps as typed tables: one service group at a time, written through a journal.

A *group* is what one service id stands for: one ServicePort's frontends of one IP family with that
family's endpoints (a dual-stack ServicePort has two). Updates touch only elements that differ,
in make-before-break order, as Cilium's service manager writes lb4_services/lb4_backends
(pkg/loadbalancer, bpf/lib/lb.h): new backends first, then slots, then the service entry (the
count is the commit point: the programs only read slots up to it), then the removal of slots past
the count and of backends nobody points to. BPF maps have no transactions, so the `Journal` keeps
the previous value of every element written and restores them all if a later write fails.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import maglev
from usproxy.offload.bpf.layout import (
    F_AFFINITY,
    F_MAGLEV,
    F_SOURCE_RANGES,
    F_TC_ONLY,
    MAGLEV_M,
    SRC_RANGE_KEY_SIZE,
    NAME_SIZE,
    AffinityEntry,
    BackendVal,
    SvcKey,
    SvcVal,
    pack_backend_key,
    pack_name,
    pack_slot_key,
    pack_src_range,
    pack_u32,
    unpack_name,
    unpack_slot_key,
    unpack_src_range,
    unpack_u32,
)
from usproxy.model.types import IPAddress

Address = tuple[IPAddress, int]


class Journal:
    """Every element written in one transaction, with its previous value, for rollback."""

    def __init__(self) -> None:
        self._undo: list[tuple[int, bytes, bytes | None]] = []
        self.writes = 0

    def put(self, fd: int, key: bytes, value: bytes, value_size: int) -> None:
        old = bpf.map_lookup(fd, key, value_size)
        if old == value:
            return
        bpf.map_update(fd, key, value)
        self._undo.append((fd, key, old))
        self.writes += 1

    def delete(self, fd: int, key: bytes, value_size: int) -> None:
        old = bpf.map_lookup(fd, key, value_size)
        if old is None:
            return
        bpf.map_delete(fd, key)
        self._undo.append((fd, key, old))
        self.writes += 1

    def insert(self, fd: int, key: bytes, value: bytes) -> None:
        """Write `key`, known to be absent: for maps whose lookup is not exact (an LPM trie
        answers a lookup with the longest prefix that matches, so `put` cannot read the old
        value); the undo deletes it."""
        bpf.map_update(fd, key, value)
        self._undo.append((fd, key, None))
        self.writes += 1

    def remove(self, fd: int, key: bytes, value: bytes) -> None:
        """Delete `key`, known to hold `value` (the counterpart of `insert`)."""
        bpf.map_delete(fd, key)
        self._undo.append((fd, key, value))
        self.writes += 1

    def rollback(self) -> None:
        """Restore every element in reverse order; best effort, the first error is raised last."""
        first: bpf.BpfError | None = None
        for fd, key, old in reversed(self._undo):
            try:
                if old is None:
                    bpf.map_delete(fd, key)
                else:
                    bpf.map_update(fd, key, old)
            except bpf.BpfError as err:
                first = first or err
        self._undo.clear()
        if first is not None:
            raise first


@dataclass
class Group:
    """One service id as installed: frontends, entry fields, slots and backends."""

    name: str
    id: int
    frontends: set[SvcKey] = field(default_factory=set)
    val: SvcVal = SvcVal(0, 0, 0, 0)
    slots: list[int] = field(default_factory=list)  # backend id of slot i+1
    backends: dict[int, Address] = field(default_factory=dict)
    maglev: list[int] | None = None  # backend id per Maglev position

    def backend_ids(self) -> dict[Address, int]:
        return {addr: bid for bid, addr in self.backends.items()}


@dataclass(frozen=True)
class Want:
    """What a group should hold."""

    name: str
    frontends: frozenset[SvcKey]
    endpoints: tuple[Address, ...]  # sorted, unique
    affinity_timeout: int
    flags: int
    sources: tuple[ipaddress.IPv4Network, ...] = ()  # F_SOURCE_RANGES: the allowed client ranges


class Tables:
    """Typed access to the pinned maps (fds by map name, owned by the caller)."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.fds = fds

    # -- writing one group --------------------------------------------------------------------
    def sync_group(self, j: Journal, old: Group | None, want: Want, ids: IdAllocator) -> Group:
        """Make the maps hold `want` for `old`'s id (or a new one); the group as now installed."""
        g = _copy(old) if old is not None else Group(want.name, ids.service())
        if old is None:
            j.put(self.fds["usp_names"], pack_u32(g.id), pack_name(want.name), NAME_SIZE)
        before = set(g.backends.values())
        gone = self._put_backends(j, g, want, ids)
        self._put_slots(j, g, want.endpoints)
        self._put_maglev(j, g, want, changed=before != set(want.endpoints))
        ranged = bool(want.sources) or (old is not None and bool(old.val.flags & F_SOURCE_RANGES))
        if ranged:
            self._put_sources(j, g.id, want.sources, add=True)
        self._put_frontends(j, g, want)
        if ranged:
            self._put_sources(j, g.id, want.sources, add=False)
        self._drop_tail_slots(j, g, old)
        self._drop_backends(j, g, gone, old)
        return g

    def _put_backends(self, j: Journal, g: Group, want: Want, ids: IdAllocator) -> list[int]:
        have = g.backend_ids()
        for addr in want.endpoints:
            if addr not in have:
                bid = ids.backend()
                j.put(self.fds["usp_backends"], pack_u32(bid), BackendVal(addr[0], addr[1], g.id).pack(),
                      BackendVal.SIZE)
                if want.flags & F_TC_ONLY:  # only the tc programs ask whether an address is a backend
                    j.put(self.fds["usp_backend_ids"], pack_backend_key(g.id, *addr), pack_u32(bid), 4)
                g.backends[bid] = addr
        wanted = set(want.endpoints)
        return [bid for bid, addr in g.backends.items() if addr not in wanted]

    def _put_slots(self, j: Journal, g: Group, eps: tuple[Address, ...]) -> None:
        ids, wanted = g.backend_ids(), set(eps)
        keep = {bid for bid in g.slots if g.backends[bid] in wanted}
        new = [ids[a] for a in eps if ids[a] not in keep]
        slots = _fill_holes(g.slots, keep, new)
        for i, bid in enumerate(slots):
            if i >= len(g.slots) or g.slots[i] != bid:
                j.put(self.fds["usp_slots"], pack_slot_key(g.id, i + 1), pack_u32(bid), 4)
        g.slots = slots

    def _put_maglev(self, j: Journal, g: Group, want: Want, changed: bool) -> None:
        """The Maglev table, recomputed only when the endpoint set changed; positions that
        differ are written (about 1/N of them for one endpoint more or less)."""
        if not (want.flags & F_MAGLEV) or not g.slots:
            if g.maglev is not None:
                j.delete(self.fds["usp_maglev"], pack_u32(g.id), 4)
            g.maglev = None
            return
        if g.maglev is not None and not changed:
            return
        ids = g.backend_ids()
        names = [f"{a[0]}:{a[1]}" for a in want.endpoints]
        order = sorted(set(names))
        by_name = {f"{a[0]}:{a[1]}": ids[a] for a in want.endpoints}
        table = [by_name[order[i]] for i in maglev.table(names, MAGLEV_M)]
        self._write_maglev(j, g, table)

    def _write_maglev(self, j: Journal, g: Group, table: list[int]) -> None:
        outer = self.fds["usp_maglev"]
        inner_fd = self._maglev_inner(g.id)
        created = inner_fd is None
        if inner_fd is None:
            inner_fd = bpf.map_create(bpf.BPF_MAP_TYPE_ARRAY, f"usp_mg_{g.id}", 4, 4, MAGLEV_M)
        try:
            before = g.maglev or [0] * MAGLEV_M
            for pos, bid in enumerate(table):
                if before[pos] != bid:
                    j.put(inner_fd, pack_u32(pos), pack_u32(bid), 4)
            if created:
                j.put(outer, pack_u32(g.id), pack_u32(inner_fd), 4)
        finally:
            os.close(inner_fd)
        g.maglev = table

    def _maglev_inner(self, svc_id: int) -> int | None:
        raw = bpf.map_lookup(self.fds["usp_maglev"], pack_u32(svc_id), 4)
        if raw is None:
            return None
        return bpf.map_get_fd_by_id(unpack_u32(raw))

    def _put_frontends(self, j: Journal, g: Group, want: Want) -> None:
        val = SvcVal(len(g.slots), g.id, want.affinity_timeout, want.flags)
        for key in sorted(want.frontends):
            j.put(self.fds["usp_services"], key.pack(), val.pack(), SvcVal.SIZE)
        for key in sorted(g.frontends - want.frontends):
            j.delete(self.fds["usp_services"], key.pack(), SvcVal.SIZE)
        g.frontends, g.val = set(want.frontends), val

    def _put_sources(self, j: Journal, svc_id: int, nets: tuple[ipaddress.IPv4Network, ...], *,
                     add: bool) -> None:
        """The group's usp_tc_sources entries: missing ones added before the service entry
        (a client in range is never dropped in between), extra ones removed after it. Reads the
        keys of the whole map, which holds only loadBalancerSourceRanges (a handful per LB IP)."""
        fd = self.fds.get("usp_tc_sources")
        if fd is None:
            return
        have = {k for k in bpf.map_keys(fd, SRC_RANGE_KEY_SIZE) if unpack_src_range(k)[0] == svc_id}
        want = {pack_src_range(svc_id, n) for n in nets}
        for key in sorted(want - have if add else have - want):
            if add:
                j.insert(fd, key, pack_u32(1))
            else:
                j.remove(fd, key, pack_u32(1))

    def _drop_tail_slots(self, j: Journal, g: Group, old: Group | None) -> None:
        for slot in range(len(g.slots) + 1, len(old.slots) + 1 if old else 0):
            j.delete(self.fds["usp_slots"], pack_slot_key(g.id, slot), 4)

    def _drop_backends(self, j: Journal, g: Group, gone: list[int], old: Group | None) -> None:
        for bid in gone:
            self._drop_backend(j, g, bid)
            del g.backends[bid]
        had = old is not None and bool(old.val.flags & F_AFFINITY)
        if had and not g.val.flags & F_AFFINITY:
            self.purge_affinity(j, g.id, set(), everything=True)
        elif gone and (had or g.val.flags & F_AFFINITY):  # only affinity services pay for the walk
            self.purge_affinity(j, g.id, set(gone), everything=False)

    def _drop_backend(self, j: Journal, g: Group, bid: int) -> None:
        j.delete(self.fds["usp_backends"], pack_u32(bid), BackendVal.SIZE)
        if g.val.flags & F_TC_ONLY:
            j.delete(self.fds["usp_backend_ids"], pack_backend_key(g.id, *g.backends[bid]), 4)

    def index_backends(self, groups: Iterable[Group]) -> int:
        """usp_backend_ids entries for the tc groups' backends that lack one (pins an agent from
        before the map left: the map is new and empty); how many were written."""
        written = 0
        for g in groups:
            if not g.val.flags & F_TC_ONLY:
                continue
            for bid, addr in g.backends.items():
                key = pack_backend_key(g.id, *addr)
                if bpf.map_lookup(self.fds["usp_backend_ids"], key, 4) is None:
                    bpf.map_update(self.fds["usp_backend_ids"], key, pack_u32(bid))
                    written += 1
        return written

    # -- removing a group ---------------------------------------------------------------------
    def remove_group(self, j: Journal, g: Group) -> None:
        """Frontends first (new connections stop matching), then what they pointed to."""
        for key in sorted(g.frontends):
            j.delete(self.fds["usp_services"], key.pack(), SvcVal.SIZE)
        for slot in range(1, len(g.slots) + 1):
            j.delete(self.fds["usp_slots"], pack_slot_key(g.id, slot), 4)
        if g.maglev is not None:
            j.delete(self.fds["usp_maglev"], pack_u32(g.id), 4)
        for bid in sorted(g.backends):
            self._drop_backend(j, g, bid)
        j.delete(self.fds["usp_names"], pack_u32(g.id), NAME_SIZE)
        if g.val.flags & F_SOURCE_RANGES:
            self._put_sources(j, g.id, (), add=False)
        if g.val.flags & F_AFFINITY:
            self.purge_affinity(j, g.id, set(), everything=True)

    def purge_affinity(self, j: Journal, svc_id: int, backends: set[int], *, everything: bool) -> None:
        """Affinity entries of `svc_id` naming one of `backends` (or all of them) go (C16)."""
        for entry in self.affinity():
            if entry.svc_id == svc_id and (everything or entry.backend_id in backends):
                j.delete(self.fds["usp_affinity"], entry.pack_key(), AffinityEntry.VAL_SIZE)

    # -- reading ------------------------------------------------------------------------------
    def affinity(self) -> list[AffinityEntry]:
        items = bpf.map_items(self.fds["usp_affinity"], AffinityEntry.KEY_SIZE, AffinityEntry.VAL_SIZE)
        return [AffinityEntry.unpack(k, v) for k, v in items]

    def backends(self) -> dict[int, BackendVal]:
        items = bpf.map_items(self.fds["usp_backends"], 4, BackendVal.SIZE)
        return {unpack_u32(k): BackendVal.unpack(v) for k, v in items}

    def read_groups(self) -> dict[int, Group]:
        """Every group the maps hold now (after an agent restart)."""
        groups: dict[int, Group] = {}
        names = bpf.map_items(self.fds["usp_names"], 4, NAME_SIZE)
        for k, v in names:
            groups[unpack_u32(k)] = Group(unpack_name(v), unpack_u32(k))
        for k, v in bpf.map_items(self.fds["usp_services"], SvcKey.SIZE, SvcVal.SIZE):
            val = SvcVal.unpack(v)
            g = groups.setdefault(val.id, Group(f"<unnamed {val.id}>", val.id))
            g.frontends.add(SvcKey.unpack(k))
            g.val = val
        self._read_slots(groups)
        for bid, be in self.backends().items():
            if be.svc_id in groups:
                groups[be.svc_id].backends[bid] = (be.ip, be.port)
        for g in groups.values():
            g.maglev = self._read_maglev(g.id)
        return groups

    def _read_slots(self, groups: dict[int, Group]) -> None:
        slots: dict[int, dict[int, int]] = {}
        for k, v in bpf.map_items(self.fds["usp_slots"], 8, 4):
            sid, slot = unpack_slot_key(k)
            slots.setdefault(sid, {})[slot] = unpack_u32(v)
        for sid, g in groups.items():
            have = slots.get(sid, {})
            g.slots = [have[i] for i in range(1, g.val.count + 1) if i in have]

    def _read_maglev(self, svc_id: int) -> list[int] | None:
        fd = self._maglev_inner(svc_id)
        if fd is None:
            return None
        try:
            return [unpack_u32(bpf.map_lookup(fd, pack_u32(i), 4) or b"\0\0\0\0") for i in range(MAGLEV_M)]
        finally:
            os.close(fd)


def _copy(g: Group) -> Group:
    return replace(g, frontends=set(g.frontends), slots=list(g.slots), backends=dict(g.backends),
                   maglev=list(g.maglev) if g.maglev is not None else None)


def _fill_holes(slots: list[int], keep: set[int], new: list[int]) -> list[int]:
    """Slots after a change with the fewest writes: kept backends stay where they are, new ones
    fill the holes of removed ones, then the last kept ones move into the remaining holes."""
    out = [bid if bid in keep else 0 for bid in slots]
    incoming: Iterator[int] = iter(new)
    for i, bid in enumerate(out):
        if bid == 0:
            out[i] = next(incoming, 0)
    out.extend(incoming)
    while out and out[-1] == 0:
        out.pop()
    while 0 in out:
        hole = out.index(0)
        out[hole] = out.pop()
        while out and out[-1] == 0:
            out.pop()
    return out


class IdAllocator:
    """Service and backend ids not in use (0 means none in the programs)."""

    def __init__(self, services: Iterable[int], backends: Iterable[int]) -> None:
        self._used = {"svc": set(services), "be": set(backends)}
        self._hint = {"svc": 1, "be": 1}

    def _next(self, kind: str) -> int:
        used, n = self._used[kind], self._hint[kind]
        while n in used:
            n += 1
        used.add(n)
        self._hint[kind] = n + 1
        return n

    def service(self) -> int:
        return self._next("svc")

    def backend(self) -> int:
        return self._next("be")


def address_family(ip: IPAddress) -> int:
    return 4 if isinstance(ip, ipaddress.IPv4Address) else 6
