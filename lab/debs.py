"""The .debs a scenario installs at boot (Scenario.debs): downloaded once by the host's apt.

The host runs the guests' release (Debian 12, bookworm: scripts/setup.sh), so `apt-get download`
fetches the very packages the guest's own apt would install; they are kept under the lab's cache
(CACHE/debs) and reused. The guest's init installs them with `dpkg -i` before the scenario runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from lab.rootfs import CACHE


def fetch(names: tuple[str, ...], arch: str = "amd64") -> list[Path]:
    """The .deb of each package in `names` for `arch`, downloading what is missing."""
    if not names:
        return []
    where = CACHE / "debs"
    where.mkdir(parents=True, exist_ok=True)
    wanted = [f"{n}:{arch}" for n in names]
    missing = [w for w, n in zip(wanted, names) if not list(where.glob(f"{n}_*_{arch}.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", "-q", *missing], cwd=where, check=True, capture_output=True)
    return [sorted(where.glob(f"{n}_*_{arch}.deb"))[-1] for n in names]
