"""FileWatch: inotify(7) on a manifest path, so the static source looks as soon as it changes.

Polling every 0.2 s put 0-200 ms of waiting in front of every edit; an inotify event wakes the
source's loop at once. It is only a hint: the source's scan (stat keys, settle rules) still
decides what is read, polling goes on as the ground truth, and where inotify is missing or runs
out of watches the source simply polls. The watch is on the directory (the file's parent for a
file), because an editor or `mv` replaces the file by a rename and a watch on the old inode would
see nothing; files in its subdirectories are found by polling.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF)
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's C library (find_library forks ldconfig)
    except OSError:
        return None
    return libc if hasattr(libc, "inotify_init1") and hasattr(libc, "inotify_add_watch") else None


class FileWatch:
    """An inotify descriptor watching the directory of `path`; `drain()` empties it."""

    def __init__(self, fd: int, directory: Path) -> None:
        self.fd = fd
        self.directory = directory

    @classmethod
    def of(cls, path: Path) -> FileWatch | None:
        """A watch on `path` (a directory) or its parent (a file); None where inotify is missing
        or refuses (no watches left: fs.inotify.max_user_watches), logged once."""
        libc = _libc()
        if libc is None:
            return None
        directory = path if path.is_dir() else path.parent
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.info("no inotify (%s): polling %s only", os.strerror(ctypes.get_errno()), path)
            return None
        if libc.inotify_add_watch(fd, os.fsencode(directory), MASK) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            log.info("no inotify watch on %s (%s): polling only", directory, os.strerror(err))
            return None
        return cls(fd, directory)

    def drain(self) -> bool:
        """Read every queued event; True when there was one (what changed is the scan's business)."""
        seen = False
        while True:
            try:
                if not os.read(self.fd, 1 << 16):
                    return seen
            except BlockingIOError:
                return seen
            except OSError:
                return True  # the queue overflowed or the watch went away: look anyway
            seen = True

    def reader(self, wake: Callable[[], None]) -> Callable[[], None]:
        """The event loop's reader callback: drain, then `wake`."""
        def on_readable() -> None:
            if self.drain():
                wake()
        return on_readable

    def close(self) -> None:
        os.close(self.fd)
