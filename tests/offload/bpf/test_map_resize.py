"""A pinned map replaced by one of another size (usproxy/offload/bpf/map_resize.py, loader.py):
entries carried over and merged, on real maps (root; no traffic: test_tc_node.py has that).

- the merge after the swap takes what the old programs changed (added, changed, deleted since the
  copy) unless the new programs wrote that key themselves;
- a smaller LRU map keeps the most recently used entries (copied oldest first, so the LRU evicts
  the oldest); a hash that is not LRU and holds more than the new size is not replaced;
- the loader: a pinned map of another size is replaced and its entries are there (a hash of maps,
  Maglev's, with the same inner maps), one that holds too much for the new size is kept (and says
  why), a table the programs loaded never use keeps its size, and the same size is the same map.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.offload.bpf.conftest import Env
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.layout import MAGLEV_M, pack_slot_key, pack_u32
from usproxy.offload.bpf.map_resize import Resize

pytestmark = pytest.mark.netns  # root: BPF maps


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def lru(fds: list[int], name: str, entries: int, key: int = 8, value: int = 16) -> int:
    fd = bpf.map_create(bpf.BPF_MAP_TYPE_LRU_HASH, name, key, value, entries)
    fds.append(fd)
    return fd


def k(i: int) -> bytes:
    return struct.pack("<Q", i)


def v(last: int, tag: int = 0) -> bytes:
    """A value whose first u64 is its last use (as usp_affinity's), then a tag."""
    return struct.pack("<QQ", last, tag)


def test_the_merge_takes_the_old_programs_changes_unless_the_new_ones_wrote(fds: list[int]) -> None:
    old, new = lru(fds, "old", 64), lru(fds, "new", 128)
    for i in range(1, 5):
        bpf.map_update(old, k(i), v(i))
    r = Resize("usp_affinity", old, 64, 128, bpf.fdinfo(old))
    assert r.copy(new) == 4
    bpf.map_update(old, k(5), v(5))  # created by the old programs between the copy and the swap
    bpf.map_update(old, k(2), v(2, tag=7))  # changed by them
    bpf.map_delete(old, k(3))  # deleted by them
    bpf.map_update(old, k(4), v(4, tag=8))  # changed by them, and ...
    bpf.map_update(new, k(4), v(40, tag=9))  # ... by the new programs after the swap: theirs is newer
    bpf.map_update(new, k(6), v(6))  # the new programs' own
    assert r.merge(new) == 3
    got = dict(bpf.map_items(new, 8, 16))
    assert got == {k(1): v(1), k(2): v(2, tag=7), k(4): v(40, tag=9), k(5): v(5), k(6): v(6)}


def test_a_smaller_lru_map_keeps_the_most_recently_used(fds: list[int]) -> None:
    old, new = lru(fds, "old", 4096), lru(fds, "new", 256)
    order = list(range(1000))
    for n, i in enumerate(reversed(order)):  # inserted newest first: the copy must not follow that
        bpf.map_update(old, k(i), v(last=1000 + i, tag=n))
    Resize("usp_affinity", old, 4096, 256, bpf.fdinfo(old)).copy(new)
    kept = {struct.unpack("<Q", key)[0] for key in bpf.map_keys(new, 8)}
    assert 0 < len(kept) <= 256
    assert set(range(950, 1000)) <= kept  # the 50 most recent are all there
    assert not kept & set(range(0, 500))  # none of the older half


def test_a_hash_that_holds_more_than_the_new_size_does_not_fit(fds: list[int]) -> None:
    old = bpf.map_create(bpf.BPF_MAP_TYPE_HASH, "old", 8, 4, 64)
    fds.append(old)
    for i in range(10):
        bpf.map_update(old, k(i), pack_u32(i))
    assert not Resize("usp_slots", old, 64, 8, bpf.fdinfo(old)).fits()
    assert Resize("usp_slots", old, 64, 10, bpf.fdinfo(old)).fits()


def test_loader_replaces_keeps_and_reuses_pinned_maps(bpf_env: Env, tmp_path: Path) -> None:
    pins = loader.PinLayout(bpf_env.pin_root)
    first = loader.SockLB(pins, bpf_env.cgroup, sizes={"usp_slots": 4096, "usp_ct": 2048, "usp_affinity": 1024,
                                                       "usp_maglev": 1024})
    first.open()
    for slot in range(1, 11):
        bpf.map_update(first.maps["usp_slots"], pack_slot_key(7, slot), pack_u32(slot))
    bpf.map_update(first.maps["usp_affinity"], b"a" * 16, struct.pack("<QII", 5, 3, 0))
    inner = bpf.map_create(bpf.BPF_MAP_TYPE_ARRAY, "usp_mg_7", 4, 4, MAGLEV_M)  # as tables.py writes one
    bpf.map_update(first.maps["usp_maglev"], pack_u32(7), pack_u32(inner))
    inner_id = bpf.fdinfo(inner)["map_id"]
    os.close(inner)
    ids = {n: bpf.fdinfo(fd)["map_id"] for n, fd in first.maps.items()}
    first.close()

    lb = loader.SockLB(pins, bpf_env.cgroup, sizes={"usp_slots": 8, "usp_ct": 1, "usp_affinity": 512, "usp_maglev": 64})
    lb.open()
    try:
        assert "holds more than 8" in lb.kept["usp_slots"] and bpf.fdinfo(lb.maps["usp_slots"])["max_entries"] == "4096"
        assert "unused" in lb.kept["usp_ct"] and bpf.fdinfo(lb.maps["usp_ct"])["max_entries"] == "2048"
        assert lb.resized == {"usp_affinity": (1024, 512), "usp_maglev": (1024, 64)}
        assert bpf.map_lookup(lb.maps["usp_maglev"], pack_u32(7), 4) == pack_u32(int(inner_id))  # the same inner map
        assert bpf.fdinfo(lb.maps["usp_affinity"])["map_id"] != ids["usp_affinity"]
        assert bpf.map_lookup(lb.maps["usp_affinity"], b"a" * 16, 16) == struct.pack("<QII", 5, 3, 0)
        assert len(list(bpf.map_keys(lb.maps["usp_slots"], 8))) == 10
        same = {n: bpf.fdinfo(fd)["map_id"] for n, fd in lb.maps.items() if n not in lb.resized}
        assert same == {n: i for n, i in ids.items() if n not in lb.resized}  # everything else reused
        assert not [p for p in pins.maps.iterdir() if "~" in p.name]  # no temporary pin left
    finally:
        lb.close()
