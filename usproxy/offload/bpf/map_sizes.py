"""How many entries each BPF map gets on this machine: sized to its memory as Cilium sizes its own.

Some maps cost their full size the moment the object loads: an LRU hash is always preallocated
(every element allocated up front: 64 bytes of kernel bookkeeping per entry beyond key and
value), and even a hash created with BPF_F_NO_PREALLOC allocates its bucket array at once (16
bytes per entry, rounded up to a power of two). At the sizes sock_lb.c used to declare, the object
held about 200 MiB of kernel memory before it served anything, and a 256 MiB machine's agent was
killed by the OOM killer (docs/lab.md, The edge machine). So sizes are set before load
(libbpf's bpf_map__set_max_entries) from flags, with Cilium's names and rules (its
BPFMapsSizeFlags and calculateDynamicBPFMapSizes, `--bpf-map-dynamic-size-ratio`):

- the connection tables and the per-socket tables (DYNAMIC) share `ratio` of the machine's total
  memory (MemTotal, as Cilium reads it), each in proportion to its default entries times its key
  and value bytes (Cilium's heuristic), clamped to Cilium's minimums for dynamic sizing (128Ki
  for TCP conntrack, 64Ki for the others) and to 16Mi; an explicit flag replaces the dynamic size
  of its maps (Cilium's bounds: 1Ki to 16Mi). Ratio 0 means the defaults (sock_lb.c's sizes).
- the load-balancing tables (services, slots, backends, names, Maglev) hold what the agent writes,
  never traffic: `--bpf-lb-map-max` (Cilium's default 65,536) sizes them, and
  `--bpf-lb-affinity-map-max` the ClientIP affinity table (0: as --bpf-lb-map-max, as Cilium);
- `--bpf-fragments-map-max` sizes the fragment table (Cilium's default 8,192, 256 to 65,536).

The tables only the tc (and XDP) programs use (TC_ONLY) get one entry when those programs are not
loaded (`--offload auto`, or tc unavailable): nothing would ever write them.

Pure: the loader (loader.py) applies a MapSizes to the object, and decides what a restart that
finds pinned maps of another size does (map_resize.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from usproxy.util.errors import ConfigError

DEFAULT_RATIO = 0.0025  # Cilium's bpf-map-dynamic-size-ratio
LIMIT_TABLE_MIN = 1 << 10  # Cilium's LimitTableMin: the smallest explicit size
LIMIT_TABLE_MAX = 1 << 24  # Cilium's LimitTableMax
LB_MAP_DEFAULT = 65536  # Cilium's DefaultLBMapMaxEntries
FRAGMENTS_DEFAULT, FRAGMENTS_MIN, FRAGMENTS_MAX = 8192, 1 << 8, 1 << 16
UNUSED = 1  # entries of a table whose programs are not loaded

# key and value bytes of each sized map (sock_lb.c's structs; layout.py describes the same bytes)
ENTRY_BYTES: dict[str, tuple[int, int]] = {
    "usp_ct": (16, 48), "usp_ct_any": (16, 48), "usp_ct_new": (16, 56), "usp_revnat": (32, 24),
    "usp_flows": (8, 88), "usp_affinity": (16, 16), "usp_frags": (12, 4), "usp_services": (24, 24),
    "usp_slots": (8, 4), "usp_backends": (4, 32), "usp_backend_ids": (24, 4), "usp_names": (4, 256),
    "usp_maglev": (4, 4),
}
PREALLOCATED = frozenset({"usp_ct", "usp_ct_any", "usp_ct_new", "usp_revnat", "usp_flows", "usp_affinity",
                          "usp_frags", "usp_maglev"})  # LRU hashes, and the Maglev hash of maps
TC_ONLY = frozenset({"usp_ct", "usp_ct_any", "usp_ct_new", "usp_frags"})
LB_MAPS = ("usp_services", "usp_slots", "usp_backends", "usp_backend_ids", "usp_names", "usp_maglev")


@dataclass(frozen=True, slots=True)
class DynamicMaps:
    """Maps sized together from the memory ratio: Cilium's flag, default, minimum."""

    names: tuple[str, ...]
    flag: str
    default: int  # entries with ratio 0 (sock_lb.c declares them)
    minimum: int  # Cilium's floor for a dynamic size

    def weight(self) -> int:
        """Default entries times key and value bytes: this group's share of the memory."""
        return self.default * sum(sum(ENTRY_BYTES[n]) for n in self.names)


DYNAMIC = (
    DynamicMaps(("usp_ct",), "--bpf-ct-global-tcp-max", 262144, 1 << 17),
    DynamicMaps(("usp_ct_any", "usp_ct_new"), "--bpf-ct-global-any-max", 131072, 1 << 16),
    DynamicMaps(("usp_revnat", "usp_flows"), "--bpf-sock-rev-map-max", 262144, 1 << 16),
)


@dataclass(frozen=True, slots=True)
class MapSizeFlags:
    """The sizing flags as given; 0 means "not given" (Cilium's convention)."""

    dynamic_size_ratio: float = DEFAULT_RATIO
    ct_global_tcp_max: int = 0
    ct_global_any_max: int = 0
    sock_rev_map_max: int = 0
    lb_map_max: int = LB_MAP_DEFAULT
    lb_affinity_map_max: int = 0
    fragments_map_max: int = FRAGMENTS_DEFAULT

    def explicit(self, flag: str) -> int:
        """The value of a DYNAMIC flag, 0 when not given."""
        return {"--bpf-ct-global-tcp-max": self.ct_global_tcp_max, "--bpf-ct-global-any-max": self.ct_global_any_max,
                "--bpf-sock-rev-map-max": self.sock_rev_map_max}[flag]


def validate(flags: MapSizeFlags) -> None:
    """Refuse what cannot be sized (exit 2); ConfigError names the flag."""
    ratio = flags.dynamic_size_ratio
    if not 0.0 <= ratio <= 1.0:  # also NaN
        raise ConfigError(f"must be between 0.0 and 1.0, got {ratio}", obj="usproxy run",
                          field="--bpf-map-dynamic-size-ratio")
    for group in DYNAMIC:
        n = flags.explicit(group.flag)
        if n and not LIMIT_TABLE_MIN <= n <= LIMIT_TABLE_MAX:
            raise ConfigError(f"must be 0 (sized to the memory) or between {LIMIT_TABLE_MIN} and {LIMIT_TABLE_MAX}, "
                              f"got {n}", obj="usproxy run", field=group.flag)
    for flag, n, low in (("--bpf-lb-map-max", flags.lb_map_max, 1),
                         ("--bpf-lb-affinity-map-max", flags.lb_affinity_map_max, 0)):
        if not low <= n <= LIMIT_TABLE_MAX:
            raise ConfigError(f"must be between {low} and {LIMIT_TABLE_MAX}, got {n}", obj="usproxy run", field=flag)
    if not FRAGMENTS_MIN <= flags.fragments_map_max <= FRAGMENTS_MAX:
        raise ConfigError(f"must be between {FRAGMENTS_MIN} and {FRAGMENTS_MAX}, got {flags.fragments_map_max}",
                          obj="usproxy run", field="--bpf-fragments-map-max")


@dataclass(frozen=True, slots=True)
class MapSizes:
    """Entries per map name, and why (the flag, "dynamic", or the tc programs' absence)."""

    entries: Mapping[str, int]
    why: Mapping[str, str]
    memory: int  # bytes of MemTotal the dynamic sizes were computed from
    ratio: float

    def kernel_bytes(self) -> int:
        """Estimated kernel memory these maps take when loaded, empty: preallocated elements
        (64 bytes of the kernel's own per entry, beyond key and value: measured on Linux 6.18,
        htab_elem and the bucket) and, for the hashes that allocate per element, their buckets
        (16 bytes per entry, rounded up to a power of two)."""
        total = 0
        for name, n in self.entries.items():
            key, value = ENTRY_BYTES[name]
            if name in PREALLOCATED:
                total += n * (64 + _round8(key) + _round8(value))
            else:
                total += 16 * (1 << max(0, math.ceil(math.log2(n))))
        return total

    def detail(self) -> str:
        """One line: how the sizes were chosen and what they cost (usproxy check, the agent's log)."""
        if self.ratio:
            head = f"dynamic: {self.ratio:g} of {_mib(self.memory)} MemTotal (--bpf-map-dynamic-size-ratio)"
        else:
            head = "defaults (--bpf-map-dynamic-size-ratio 0)"
        groups: dict[tuple[int, str], list[str]] = {}
        for name, n in self.entries.items():
            groups.setdefault((n, self.why[name]), []).append(name)
        parts = [f"{'/'.join(names)} {n:,} ({why})" for (n, why), names in groups.items()]
        return f"{head}; {'; '.join(parts)}; about {_mib(self.kernel_bytes())} of kernel memory"


def plan(flags: MapSizeFlags, memory: int, *, tc: bool) -> MapSizes:
    """The entries of every sized map for a machine of `memory` bytes (MemTotal); `tc`: the tc
    programs load (else TC_ONLY maps get UNUSED entries)."""
    entries: dict[str, int] = {}
    why: dict[str, str] = {}
    share = _dynamic(flags.dynamic_size_ratio, memory)
    for group in DYNAMIC:
        given = flags.explicit(group.flag)
        n = given or share(group)
        for name in group.names:
            entries[name], why[name] = n, group.flag if given else "dynamic" if flags.dynamic_size_ratio else "default"
    for name in LB_MAPS:
        entries[name], why[name] = flags.lb_map_max, "--bpf-lb-map-max"
    affinity = flags.lb_affinity_map_max
    entries["usp_affinity"] = affinity or flags.lb_map_max
    why["usp_affinity"] = "--bpf-lb-affinity-map-max" if affinity else "--bpf-lb-map-max"
    entries["usp_frags"], why["usp_frags"] = flags.fragments_map_max, "--bpf-fragments-map-max"
    if not tc:
        for name in TC_ONLY:
            entries[name], why[name] = UNUSED, "tc programs not loaded"
    return MapSizes(entries, why, memory, flags.dynamic_size_ratio)


def _dynamic(ratio: float, memory: int) -> Callable[[DynamicMaps], int]:
    """Cilium's calculator: a group's share of ratio × memory, in proportion to its weight."""
    budget = int(memory * ratio)
    total = sum(g.weight() for g in DYNAMIC)

    def share(group: DynamicMaps) -> int:
        if ratio <= 0.0:
            return group.default
        return min(max(group.default * budget // total, group.minimum), LIMIT_TABLE_MAX)
    return share


def total_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemTotal in bytes (what Cilium's go-osstat reads)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{meminfo}: no MemTotal")


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"
