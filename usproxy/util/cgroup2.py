"""Where this host mounts cgroup v2: the default --bpf-cgroup, the directory the BPF socket LB
attaches to. A host with cgroup v2 alone (systemd's unified hierarchy, most distributions since
2021) mounts it at /sys/fs/cgroup; a hybrid one (v1 controllers beside it) at
/sys/fs/cgroup/unified; a cgroup v1 host nowhere. The mount table says which, not a guess.
"""

from __future__ import annotations

import re
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
FALLBACK = Path("/sys/fs/cgroup")  # where none is mounted: the socket LB's probe names it as missing
_ESCAPE = re.compile(r"\\([0-7]{3})")  # the kernel writes a space in a path as \040


def mount_point(mountinfo: str | None = None) -> Path:
    """The first cgroup v2 mount of the whole hierarchy (root "/") in `mountinfo` (this process's
    /proc/self/mountinfo when None), else the first cgroup v2 mount of any root, else FALLBACK."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return FALLBACK
    mounts = [m for m in (_cgroup2(line) for line in mountinfo.splitlines()) if m is not None]
    whole = [point for root, point in mounts if root == "/"]
    return Path((whole or [point for _, point in mounts] or [str(FALLBACK)])[0])


def _cgroup2(line: str) -> tuple[str, str] | None:
    """(root, mount point) of one mountinfo line when it is a cgroup2 mount. The fields: ID, parent
    ID, major:minor, root, mount point, options, optional fields ending at "-", then the type."""
    left, sep, right = line.partition(" - ")
    fields = left.split()
    if not sep or len(fields) < 5 or right.split()[:1] != ["cgroup2"]:
        return None
    return _unescape(fields[3]), _unescape(fields[4])


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)
