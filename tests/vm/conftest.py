"""The arm64 root file system takes the longest to build (its debootstrap second stage runs
through qemu-user; scripts/setup.sh normally built it already): when test_arm64 is collected and
that root is not cached yet, its build starts in the background as the session starts, so it
overlaps the amd64 scenarios instead of following them; test_arm64's `vm.sh arm64` then waits for
it (one build per architecture at a time, lab/rootfs.py) and finds it cached. A build still
running when the session ends is stopped (it removes its half-built root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_build: subprocess.Popen[bytes] | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if not any(item.name == "test_arm64" for item in session.items):
        return
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in ("qemu-system-aarch64", "qemu-aarch64-static", "debootstrap")):
        return
    from lab import rootfs

    if rootfs.cached("arm64") is not None:
        return
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "usproxy-lab-build-arm64.log"
    _build = subprocess.Popen(["bash", str(ROOT / "scripts" / "vm.sh"), "build", "arm64"],
                              stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _build is not None and _build.poll() is None:
        _build.terminate()
        try:
            _build.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _build.kill()
            _build.wait()
