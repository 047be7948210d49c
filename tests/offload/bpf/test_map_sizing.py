"""BPF map sizes (usproxy/offload/bpf/map_sizes.py), without the kernel: Cilium's dynamic rule
(a share of MemTotal per group of maps in proportion to default entries times key and value
bytes, Cilium's minimums, 16Mi at most), explicit flags over it, ratio 0 for the defaults, the
load-balancing tables at --bpf-lb-map-max, one entry for the tc programs' tables when those
programs are not loaded; and that the table agrees with sock_lb.c and layout.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from usproxy.offload.bpf import layout, map_sizes
from usproxy.offload.bpf.map_sizes import DYNAMIC, MapSizeFlags, plan
from usproxy.util.errors import ConfigError

MIB, GIB = 2**20, 2**30
SOURCE = Path(map_sizes.__file__).with_name("sock_lb.c")


def declared() -> dict[str, int]:
    """max_entries of every map sock_lb.c declares (the C is what ratio 0 keeps)."""
    text = SOURCE.read_text()
    out = {}
    for body, name in re.findall(r"struct \{(.*?)\} (usp_\w+) SEC\(\"\.maps\"\)", text, re.S):
        m = re.search(r"max_entries, (\d+)(?: << (\d+))?\)", body)
        if m:
            out[name] = int(m.group(1)) << int(m.group(2) or 0)
    return out


def test_a_small_machine_gets_ciliums_minimums_and_one_entry_where_tc_does_not_run() -> None:
    sizes = plan(MapSizeFlags(), 217 * MIB, tc=True).entries  # the lab's 256 MiB guest: 217 MiB MemTotal
    assert sizes["usp_ct"] == 1 << 17  # Cilium's limitTableAutoGlobalTCPMin
    assert sizes["usp_ct_any"] == sizes["usp_ct_new"] == 1 << 16  # limitTableAutoGlobalAnyMin
    assert sizes["usp_revnat"] == sizes["usp_flows"] == 1 << 16  # LimitTableAutoSockRevNatMin
    local = plan(MapSizeFlags(), 217 * MIB, tc=False)
    assert {n for n, e in local.entries.items() if e == map_sizes.UNUSED} == map_sizes.TC_ONLY
    assert all(local.why[n] == "tc programs not loaded" for n in map_sizes.TC_ONLY)


def test_a_large_machine_shares_its_budget_in_proportion_to_the_defaults() -> None:
    memory = 64 * GIB
    p = plan(MapSizeFlags(), memory, tc=True)
    budget = memory * 0.0025
    spent = sum(p.entries[n] * sum(map_sizes.ENTRY_BYTES[n]) for g in DYNAMIC for n in g.names)
    assert budget * 0.999 < spent <= budget  # the whole share, in key and value bytes (Cilium's measure)
    assert p.entries["usp_ct"] > 262144  # above the defaults: this machine's share is bigger
    for g in DYNAMIC:  # every group scaled by the same factor
        assert abs(p.entries[g.names[0]] / g.default - p.entries["usp_ct"] / 262144) < 1e-4
    assert plan(MapSizeFlags(dynamic_size_ratio=1.0), 1 << 40, tc=True).entries["usp_ct"] == map_sizes.LIMIT_TABLE_MAX


def test_sizes_grow_with_memory_and_never_fall_below_the_minimums() -> None:
    last: dict[str, int] = {}
    for gib in (0.25, 1, 4, 16, 24, 64, 256):
        now = plan(MapSizeFlags(), int(gib * GIB), tc=True).entries
        for g in DYNAMIC:
            for n in g.names:
                assert now[n] >= g.minimum and now[n] >= last.get(n, 0)
        last = dict(now)


def test_explicit_flags_win_and_ratio_0_keeps_the_defaults() -> None:
    flags = MapSizeFlags(ct_global_tcp_max=5000, ct_global_any_max=3000, sock_rev_map_max=2048, lb_map_max=1024,
                         fragments_map_max=256)
    p = plan(flags, 217 * MIB, tc=True)
    assert (p.entries["usp_ct"], p.entries["usp_ct_any"], p.entries["usp_ct_new"]) == (5000, 3000, 3000)
    assert p.entries["usp_revnat"] == p.entries["usp_flows"] == 2048
    assert all(p.entries[n] == 1024 for n in map_sizes.LB_MAPS) and p.entries["usp_affinity"] == 1024
    assert p.entries["usp_frags"] == 256 and p.why["usp_ct"] == "--bpf-ct-global-tcp-max"
    assert plan(MapSizeFlags(lb_affinity_map_max=4096), GIB, tc=True).entries["usp_affinity"] == 4096
    static = plan(MapSizeFlags(dynamic_size_ratio=0.0), 217 * MIB, tc=True)
    c = declared()
    assert all(static.entries[n] == c[n] for g in DYNAMIC for n in g.names)
    assert all(static.entries[n] == c[n] for n in (*map_sizes.LB_MAPS, "usp_affinity", "usp_frags"))


@pytest.mark.parametrize("flags, flag", [
    (MapSizeFlags(dynamic_size_ratio=-0.1), "--bpf-map-dynamic-size-ratio"),
    (MapSizeFlags(dynamic_size_ratio=float("nan")), "--bpf-map-dynamic-size-ratio"),
    (MapSizeFlags(ct_global_any_max=1023), "--bpf-ct-global-any-max"),
    (MapSizeFlags(sock_rev_map_max=(1 << 24) + 1), "--bpf-sock-rev-map-max"),
    (MapSizeFlags(lb_affinity_map_max=-1), "--bpf-lb-affinity-map-max"),
    (MapSizeFlags(fragments_map_max=255), "--bpf-fragments-map-max"),
])
def test_out_of_bounds_flags_are_refused_naming_the_flag(flags: MapSizeFlags, flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        map_sizes.validate(flags)
    assert err.value.field == flag


def test_the_table_agrees_with_sock_lb_c_and_layout() -> None:
    c = declared()
    for g in DYNAMIC:
        assert all(c[n] == g.default for n in g.names), g
    bytes_of = map_sizes.ENTRY_BYTES
    for name, value in layout.CT_MAPS.items():
        assert bytes_of[name] == (layout.CtEntry.KEY_SIZE, value)
    assert bytes_of["usp_revnat"] == (layout.REVNAT_KEY_SIZE, layout.REVNAT_VAL_SIZE)
    assert bytes_of["usp_flows"] == (layout.FlowVal.KEY_SIZE, layout.FlowVal.SIZE)
    assert bytes_of["usp_affinity"] == (layout.AffinityEntry.KEY_SIZE, layout.AffinityEntry.VAL_SIZE)
    assert bytes_of["usp_services"] == (layout.SvcKey.SIZE, layout.SvcVal.SIZE)
    assert bytes_of["usp_backends"] == (4, layout.BackendVal.SIZE)
    assert bytes_of["usp_backend_ids"] == (layout.BACKEND_KEY_SIZE, 4)
    assert bytes_of["usp_names"] == (4, layout.NAME_SIZE)
    assert set(bytes_of) <= set(c)


def test_the_detail_says_how_and_what_it_costs() -> None:
    text = plan(MapSizeFlags(), 217 * MIB, tc=False).detail()
    assert text.startswith("dynamic: 0.0025 of 217.0 MiB MemTotal (--bpf-map-dynamic-size-ratio)")
    assert "usp_ct/usp_ct_any/usp_ct_new/usp_frags 1 (tc programs not loaded)" in text
    assert "usp_revnat/usp_flows 65,536 (dynamic)" in text and text.endswith("of kernel memory")


def test_memtotal_is_read_from_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:         222208 kB\nMemFree:           1000 kB\n")
    assert map_sizes.total_memory(f) == 222208 * 1024
    f.write_text("MemFree: 1 kB\n")
    with pytest.raises(OSError):
        map_sizes.total_memory(f)
