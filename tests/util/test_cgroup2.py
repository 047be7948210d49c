"""util/cgroup2: the default --bpf-cgroup is where the mount table puts cgroup v2."""

from __future__ import annotations

from pathlib import Path

from usproxy.util import cgroup2

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda1 rw
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
V1_ONLY = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
"""


def test_a_hybrid_host_mounts_cgroup2_under_unified() -> None:
    assert cgroup2.mount_point(HYBRID) == Path("/sys/fs/cgroup/unified")


def test_a_host_with_cgroup_v2_alone_mounts_it_at_sys_fs_cgroup() -> None:
    """Optional fields (shared:9) sit between the options and the "-" that ends them."""
    assert cgroup2.mount_point(UNIFIED) == Path("/sys/fs/cgroup")


def test_a_cgroup_v1_host_falls_back_to_sys_fs_cgroup_which_the_probe_names_as_missing() -> None:
    assert cgroup2.mount_point(V1_ONLY) == cgroup2.FALLBACK == Path("/sys/fs/cgroup")
    assert cgroup2.mount_point("") == cgroup2.FALLBACK


def test_the_whole_hierarchy_wins_over_a_bind_mount_of_a_subtree() -> None:
    """A container's bind mount of one cgroup (root /kubepods/x) is not where the host's
    hierarchy is; the whole one (root /) is chosen even when listed after it."""
    text = ("50 30 0:38 /kubepods/x /run/sub rw - cgroup2 cgroup2 rw\n"
            "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    assert cgroup2.mount_point(text) == Path("/sys/fs/cgroup")
    assert cgroup2.mount_point(text.splitlines()[0]) == Path("/run/sub")


def test_a_space_in_the_mount_point_is_read_back_from_the_kernels_escape() -> None:
    assert cgroup2.mount_point(r"41 31 0:38 / /mnt/cg\0402 rw - cgroup2 cgroup2 rw") == Path("/mnt/cg 2")


def test_a_filesystem_named_like_cgroup2_in_the_options_is_not_taken() -> None:
    """Only the type field after " - " counts, not a mount point or option that says cgroup2."""
    assert cgroup2.mount_point("41 31 0:38 / /cgroup2 rw - tmpfs cgroup2 rw") == cgroup2.FALLBACK


def test_this_process_reads_its_own_mount_table() -> None:
    """With no text given it reads /proc/self/mountinfo: the answer is one of its cgroup2 mounts,
    or the fallback where it has none."""
    listed = cgroup2.MOUNTINFO.read_text()
    got = cgroup2.mount_point()
    assert got == cgroup2.mount_point(listed)
    assert f" {got} " in listed or got == cgroup2.FALLBACK
