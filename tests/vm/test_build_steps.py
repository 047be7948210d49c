"""The lab's root build steps that run on the host (lab/rootfs.py, lab/foreign.py), without
building a root: the binfmt_misc line the arm64 build registers, the Packages index cut before
debootstrap's second stage, and that the private handler exists only inside the build's own
namespace. Seconds, not minutes (the whole builds are measured in docs/lab.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lab import foreign, rootfs


def test_handler_is_debians_under_the_labs_name_with_the_f_flag() -> None:
    conf = foreign.DEBIAN_HANDLER["arm64"]
    if not conf.exists() or shutil.which(foreign.QEMU_USER["arm64"]) is None:
        pytest.skip("qemu-user-static is not installed (bash scripts/setup.sh installs it)")
    debian = conf.read_text().strip().split(":")
    ours = foreign.handler("arm64").split(":")
    assert ours[1] == "usproxy-lab-arm64"
    assert "F" in ours[7]
    # the same match (type, offset, magic, mask) and interpreter as Debian's own
    assert ours[2:7] == debian[2:7]


def test_trim_index_keeps_only_the_packages_being_installed(tmp_path: Path) -> None:
    (tmp_path / "debootstrap").mkdir()
    (tmp_path / "debootstrap/required").write_text("dpkg libc6\n")
    (tmp_path / "debootstrap/base").write_text("nftables\n")
    lists = tmp_path / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    stanzas = [f"Package: {name}\nVersion: 1\nDepends: x" for name in ("dpkg", "gcc", "libc6", "nftables", "nftables-doc")]
    (lists / "deb.debian.org_debian_dists_bookworm_main_binary-arm64_Packages").write_text("\n\n".join(stanzas) + "\n")
    rootfs.trim_index(tmp_path)
    kept = (lists / "deb.debian.org_debian_dists_bookworm_main_binary-arm64_Packages").read_text()
    names = [line.split()[1] for line in kept.splitlines() if line.startswith("Package: ")]
    assert names == ["dpkg", "libc6", "nftables"]


def test_private_handler_is_seen_only_inside_the_builds_namespace() -> None:
    if os.geteuid() != 0:
        pytest.skip("user namespaces with a one-to-one id map need root")
    try:
        foreign.handler("arm64")
    except foreign.ForeignError as err:
        pytest.skip(str(err))
    if not foreign.private_works("arm64"):
        pytest.skip("this kernel gives no user namespace a binfmt_misc of its own (Linux 6.7+)")
    launcher = foreign.private_launcher("arm64")
    entry = "/proc/sys/fs/binfmt_misc/usproxy-lab-arm64"
    proc = subprocess.Popen([*launcher.prefix, "cat", entry], env={**os.environ, **launcher.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert launcher.on_start is not None
    launcher.on_start(proc)
    out, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    lines = out.decode().splitlines()
    flags = [line.split(":", 1)[1] for line in lines if line.startswith("flags:")]
    assert lines[0] == "enabled" and flags and "F" in flags[0], lines
    # the machine's binfmt_misc (mounted or not) never had it
    assert not Path(entry).exists()
