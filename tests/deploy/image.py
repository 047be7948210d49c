"""The container image as the tests see it: built by scripts/image.sh, inspected and mounted
with buildah (no container can be started on these machines, but an image's root file system
can be mounted and run chrooted: sandbox.py).

`build()` runs the script (the base and layers come from its caches when they are current) and
returns a BuiltImage; `mounted()` gives a writable container layer over the image (buildah from
+ mount), removed afterwards, as a runtime gives each container its own.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IMAGE_SH = ROOT / "scripts" / "image.sh"


@dataclass(frozen=True, slots=True)
class BuiltImage:
    """tag: "usproxy:<version>"; size_bytes: the unpacked root file system (du -sb);
    build_seconds: wall time of scripts/image.sh; config: the OCI image config (Entrypoint,
    Cmd, Env, ExposedPorts, ...)."""

    tag: str
    image_id: str
    size_bytes: int
    build_seconds: float
    config: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config.get("Env", []))


def build(log: Path) -> BuiltImage:
    """Run scripts/image.sh (its progress goes to `log`); raise with the log's tail on failure."""
    start = time.monotonic()
    with log.open("wb") as err:
        proc = subprocess.run(["bash", str(IMAGE_SH)], stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/image.sh exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    tag, image_id, size = proc.stdout.decode().strip().splitlines()[-1].split()
    return BuiltImage(tag, image_id, int(size), took, inspect(tag))


def inspect(tag: str) -> dict[str, Any]:
    out = subprocess.run(["buildah", "inspect", "--type", "image", tag], check=True, capture_output=True,
                         text=True).stdout
    return dict(json.loads(out)["OCIv1"]["config"])


@contextlib.contextmanager
def mounted(tag: str) -> Iterator[Path]:
    """A new container of `tag` (never pulled), its root file system mounted; removed after."""
    ctr = subprocess.run(["buildah", "from", "--quiet", "--pull-never", tag],
                         check=True, capture_output=True, text=True).stdout.strip()
    try:
        mnt = subprocess.run(["buildah", "mount", ctr], check=True, capture_output=True, text=True).stdout.strip()
        yield Path(mnt)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)


def chroot(rootfs: Path, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `argv` inside the image's root file system (no namespaces: for commands that only read)."""
    return subprocess.run(["chroot", str(rootfs), *argv], env=env, capture_output=True, text=True, timeout=60)
