"""The agent's lock files (usproxy/util/locks.py NetnsLock, usproxy/offload/pin_root.py PinsLock), in a temporary LOCK_DIR: a
BPF agent waits for a pin root lock held briefly (an agent removing an earlier run's pins) and
names the holder when it stays held; a lock file released (and unlinked) after another process
opened it is recognised as stale."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from usproxy.offload.pin_root import PinsLock
from usproxy.util import locks
from usproxy.util.locks import NetnsLock
from usproxy.util.errors import AlreadyRunning


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(locks, "LOCK_DIR", tmp_path / "run")
    return tmp_path / "run"


async def test_a_pins_lock_held_briefly_is_waited_for_one_held_on_is_named(tmp_path: Path) -> None:
    root = tmp_path / "pins"
    cleaner = PinsLock(root)
    cleaner.acquire()
    asyncio.get_running_loop().call_later(0.3, cleaner.release)
    bpf_agent = PinsLock(root)
    await bpf_agent.acquire_within(bpf_agent.wait)  # within 5 s: the cleaner is done after 0.3 s
    try:
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}.* uses the BPF pins under {root}"):
            await PinsLock(root).acquire_within(0.3)
    finally:
        bpf_agent.release()


def test_pin_roots_spelled_differently_share_one_lock(tmp_path: Path) -> None:
    first = PinsLock(tmp_path / "pins")
    first.acquire()
    try:
        with pytest.raises(AlreadyRunning):
            PinsLock(Path(f"{tmp_path}//pins/")).acquire()
    finally:
        first.release()


def test_a_lock_file_opened_before_its_release_is_seen_as_stale(tmp_path: Path, lock_dir: Path) -> None:
    """release() unlinks the file: a waiter that opened it before would lock the unlinked file
    while a newcomer locks a fresh one under the same name; acquire() reopens when the name no
    longer names the file it locked (_same_file)."""
    held = NetnsLock("usptest0")
    held.acquire()
    stale = os.open(held.path, os.O_RDWR)  # opened before the release, as a racing waiter would
    held.release()
    try:
        assert not locks._same_file(stale, held.path)  # acquire() would reopen instead of keeping it
        newcomer = NetnsLock("usptest0")
        newcomer.acquire()
        with pytest.raises(AlreadyRunning):
            NetnsLock("usptest0").acquire()
        newcomer.release()
    finally:
        os.close(stale)
