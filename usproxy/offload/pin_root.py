"""Where the BPF datapath pins its programs, links and maps (bpffs), without loading BPF code.

The pin root is /sys/fs/bpf/usproxy, or $USPROXY_BPF_PINS (tests, or two agents on one node). It is
node-wide, not per network namespace: one agent with `--offload bpf` per pin root, held by a lock
(`lock_name`). An agent without BPF reads it at start to remove an earlier run's pins
(usproxy/app/cleanup.py), so this module must stay light: no libbpf, no BPF object.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from usproxy.util import locks

BPFFS = Path("/sys/fs/bpf")
DEFAULT_PIN_ROOT = BPFFS / "usproxy"
PIN_ROOT_ENV = "USPROXY_BPF_PINS"  # another pin root: tests, or two agents on one node


def default_pin_root() -> Path:
    """$USPROXY_BPF_PINS, else /sys/fs/bpf/usproxy."""
    return Path(os.environ.get(PIN_ROOT_ENV) or DEFAULT_PIN_ROOT)


def has_pins(root: Path) -> bool:
    """Whether `root` holds anything (an earlier run's pins); False when it is absent or unreadable
    (bpffs not mounted here, e.g. under `ip netns exec`)."""
    try:
        return root.is_dir() and any(root.iterdir())
    except OSError:
        return False


def lock_name(root: Path) -> str:
    """The lock file name (under /run/usproxy) of the agent that owns the pins under `root`."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return f"bpf-pins-{digest}.lock"


class PinsLock(locks.NetnsLock):
    """An flock on /run/usproxy/bpf-pins-<hash>.lock for the BPF pin root `root` (node-wide):
    held by the agent that runs `--offload bpf` with it, taken briefly by an agent without BPF that
    removes an earlier run's pins (which a starting BPF agent waits for: `wait`)."""

    wait = 5.0

    def __init__(self, root: Path) -> None:
        self.fd = None
        self.what = f"BPF pins under {root}"
        self.path = locks.LOCK_DIR / lock_name(root)

    def held_by(self, holder: str) -> str:
        return f"another usproxy agent (pid {holder}) uses the {self.what}"
