"""Lock files under /run/usproxy: one agent per network namespace and purpose (NetnsLock).

A lock is an flock on a file that holds its holder's pid, so a second agent can say which one
runs; the file is unlinked on release, and a file unlinked by its releasing holder while another
process opened it is reopened, never locked stale (`_same_file`). Subclasses name other scopes
(usproxy/offload/pin_root.py PinsLock: a BPF pin root, node-wide).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path

from usproxy.util.errors import AlreadyRunning, CannotRun

LOCK_DIR = Path("/run/usproxy")


class NetnsLock:
    """An flock on /run/usproxy/netns-<inode>-<what>.lock for this network namespace."""

    wait = 0.0  # seconds acquire_within retries while another holds it (a running agent: none)

    def __init__(self, what: str) -> None:
        self.fd: int | None = None
        self.what = what
        self.path = LOCK_DIR / f"netns-{os.stat('/proc/self/ns/net').st_ino}-{what}.lock"

    def held_by(self, holder: str) -> str:
        """Why acquiring failed, with the holder's pid."""
        return (f"another usproxy agent (pid {holder}) runs in this network namespace "
                f"({'with kernel offload' if self.what == 'offload' else 'on ' + self.what})")

    async def acquire_within(self, wait: float) -> None:
        """`acquire`, retried every 0.1 s for up to `wait` seconds while another holds the lock
        (one held briefly, e.g. by an agent removing leftovers, is waited for)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self.acquire()
            except AlreadyRunning:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.1)

    def acquire(self) -> None:
        """Take the lock now; raises AlreadyRunning naming the holder's pid, CannotRun when the
        lock file cannot be made (not root, a read-only /run)."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise AlreadyRunning(self.held_by(holder)) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder released it (and unlinked the file) as we opened it: again
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Unlock and remove the file (if it is still ours), so no lock files pile up."""
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


    def _open(self) -> int:
        try:
            LOCK_DIR.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            hint = "; run usproxy as root" if isinstance(err, PermissionError) else ""
            raise CannotRun(f"cannot make the lock file {self.path}: {err.strerror or err}{hint}") from None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open at `fd` (release() unlinks it)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False
