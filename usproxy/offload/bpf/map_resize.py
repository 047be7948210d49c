"""A pinned map replaced by one of another size at an agent restart, its entries carried over.

A BPF map's size is fixed when it is created, so a restart whose sizes (map_sizes.py) differ from
what the pins hold must either keep the pinned map or make a new one. Cilium recreates such maps
and loses their entries (its connection tracking starts empty after a bpf-ct-global-*-max change);
usproxy carries them over instead, so established flows keep their conntrack entries, steered
sockets their reverse translation and clients their affinity:

1. before the new programs are attached, every entry of the old map is copied into the new one
   (`copy`), least recently used first where the value says when it was last used, so that a
   smaller LRU map evicts the oldest;
2. the links swap to the new programs (loader.py): from then on only the new map is written;
3. what the old programs changed between 1 and 2 is merged in (`merge`): an entry created since
   is added, one changed or deleted since is changed or deleted, unless the new programs already
   wrote that key themselves (theirs is newer);
4. the new map is pinned in the old one's place (a rename on bpffs: no moment without a pin).

A hash that is not LRU (the load-balancing tables) cannot take more entries than its size: when
the old one holds more than the new size, the old map is kept (`fits` says so) and the agent logs
why. A hash of maps (usp_maglev) holds inner map ids when read and takes fds when written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from usproxy.offload.bpf import libbpf as bpf

log = logging.getLogger(__name__)

# where a value holds its last use (CLOCK_MONOTONIC ns, a u64), for the order of the copy
LAST_USED_OFFSET: dict[str, int] = {"usp_ct": 32, "usp_ct_any": 32, "usp_ct_new": 32, "usp_flows": 8,
                                    "usp_affinity": 0}


@dataclass
class Resize:
    """One map being replaced: the old (pinned) map's fd and shape, and what `copy` wrote."""

    name: str
    old_fd: int
    old_entries: int
    new_entries: int
    info: dict[str, str]  # the old map's fdinfo: map_type, key_size, value_size
    copied: dict[bytes, bytes] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, old_fd: int, new_entries: int) -> Resize:
        info = bpf.fdinfo(old_fd)
        return cls(name, old_fd, int(info["max_entries"]), new_entries, info)

    @property
    def lru(self) -> bool:
        return int(self.info["map_type"]) == bpf.BPF_MAP_TYPE_LRU_HASH

    @property
    def of_maps(self) -> bool:
        return int(self.info["map_type"]) == bpf.BPF_MAP_TYPE_HASH_OF_MAPS

    def items(self) -> dict[bytes, bytes]:
        return dict(bpf.map_items(self.old_fd, int(self.info["key_size"]), int(self.info["value_size"])))

    def fits(self) -> bool:
        """Whether the new size can hold what the old map holds (an LRU map always can: it evicts)."""
        return self.lru or self.new_entries >= sum(1 for _ in bpf.map_keys(self.old_fd, int(self.info["key_size"])))

    def copy(self, new_fd: int) -> int:
        """Step 1: every entry of the old map into the new one, oldest first; how many."""
        self.copied = self.items()
        offset = LAST_USED_OFFSET.get(self.name)
        keys = sorted(self.copied, key=lambda k: _u64(self.copied[k], offset)) if offset is not None else list(self.copied)
        for key in keys:
            self._put(new_fd, key, self.copied[key], bpf.BPF_ANY)
        return len(keys)

    def merge(self, new_fd: int) -> int:
        """Step 3: what the old programs changed since `copy`, where the new ones did not write;
        how many entries changed."""
        now = self.items()
        size = int(self.info["value_size"])
        changed = 0
        for key in set(now) | set(self.copied):
            base, theirs = self.copied.get(key), now.get(key)
            if base == theirs:
                continue
            mine = bpf.map_lookup(new_fd, key, size)
            if mine != base:  # the new programs wrote it (or dropped it) since the swap: theirs wins
                continue
            if theirs is None:
                bpf.map_delete(new_fd, key)
            else:
                self._put(new_fd, key, theirs, bpf.BPF_NOEXIST if base is None else bpf.BPF_ANY)
            changed += 1
        return changed

    def _put(self, fd: int, key: bytes, value: bytes, flags: int) -> None:
        if not self.of_maps:
            try:
                bpf.map_update(fd, key, value, flags)
            except bpf.BpfError as err:  # NOEXIST: the new programs made it meanwhile
                if flags != bpf.BPF_NOEXIST:
                    raise
                log.debug("bpf: %s: %s", self.name, err)
            return
        inner = bpf.map_get_fd_by_id(int.from_bytes(value[:4], "little"))  # ids out, fds in
        try:
            bpf.map_update(fd, key, inner.to_bytes(4, "little"), flags)
        finally:
            os.close(inner)


def _u64(value: bytes, offset: int) -> int:
    return int.from_bytes(value[offset:offset + 8], "little")
