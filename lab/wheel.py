"""usproxy's wheel of the current source, as a user installs it (`pip wheel`), for every guest.

Built from a copy of the source (pyproject.toml, setup.py, usproxy/), so the checkout gets no
build/ or egg-info; setup.py compiles the BPF object into it with the host's clang. The same
wheel goes to amd64 and arm64 guests. Cached under the lab's cache by a hash of that source:
another build of the same source is skipped; other sources' wheels stay a day (other worktrees).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.rootfs import CACHE, REPO, log

PARTS = ("pyproject.toml", "setup.py")


def source_files() -> list[Path]:
    files = [REPO / p for p in PARTS]
    files += sorted(f for f in (REPO / "usproxy").rglob("*")
                    if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".o"))
    return files


def source_hash() -> str:
    h = hashlib.sha256()
    for f in source_files():
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def usproxy_wheel() -> Path:
    """The wheel of the current source: cached, or built now (~20 s)."""
    out = CACHE / "wheels" / source_hash()
    found = sorted(out.glob("usproxy-*.whl")) if out.exists() else []
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(prefix="usproxy-lab-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for p in PARTS:
            shutil.copy(REPO / p, src / p)
        shutil.copytree(REPO / "usproxy", src / "usproxy", ignore=shutil.ignore_patterns("__pycache__", "*.o"))
        dist = Path(tmp) / "dist"
        log("building usproxy's wheel (pip wheel --no-deps)")
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                               "-w", str(dist), str(src)], capture_output=True, text=True, cwd=tmp, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"pip wheel failed: {proc.stderr.strip()[-1500:]}")
        (wheel,) = dist.glob("usproxy-*.whl")
        for old in (CACHE / "wheels").glob("*"):  # other sources' wheels: kept a day (other worktrees)
            if time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, out / f".{wheel.name}.tmp")
        os.replace(out / f".{wheel.name}.tmp", out / wheel.name)  # whole or absent
    return out / wheel.name
