"""Running a block of code in another network namespace, from one thread.

setns(2) moves only the calling thread, so `inside` is safe beside other threads (each keeps its
own namespace) and returns the thread to where it was even when the block raises. Python 3.11 has
no os.setns, hence libc's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def setns(fd: int) -> None:
    """Move this thread into the network namespace open at `fd`."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """The block runs with this thread in network namespace `ns` (/run/netns/NS), and back after."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        setns(target)
        yield
    finally:
        setns(original)
        os.close(original)
        os.close(target)
