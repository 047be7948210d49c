"""The VM lab's console watch (lab/machine.py): a guest whose kernel reports a CPU stuck for
LOCKUP_GIVE_UP_S seconds or more is given up at once with that line as the reason, not at the
timeout; a shorter report (a stall the guest can come out of under an emulator) is not; a guest
that powers off ends the watch without waiting for the timeout. qemu is stood in for by a shell
script printing a console."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from lab import machine


def watch(tmp_path: Path, script: str, timeout_s: float = 60.0) -> tuple[machine.Outcome, float]:
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    start = time.monotonic()
    try:
        out = machine._watch(proc, tmp_path / "console.log", start, "tcg", timeout_s, quiet=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    return out, time.monotonic() - start


def test_a_long_lockup_gives_the_guest_up_at_once(tmp_path: Path) -> None:
    line = "[  136.373448] watchdog: BUG: soft lockup - CPU#0 stuck for 125s! [usproxy:293]"
    out, took = watch(tmp_path, f"echo booting; echo '{line}'; exec sleep 60")  # exec: the kill ends the console too
    assert out.exit_reason == f"locked up: {line}"
    assert took < 30  # not the 60 s timeout, nor the guest's sleep
    assert line in (tmp_path / "console.log").read_text()


def test_a_short_stall_report_is_only_noted(tmp_path: Path) -> None:
    out, _ = watch(tmp_path, "echo '[   72.37] watchdog: BUG: soft lockup - CPU#1 stuck for 45s! [ksoftirqd/1:21]'; "
                             "sleep 0.2; exit 0")
    assert out.exit_reason == "poweroff"
    assert out.lines[-1].endswith("[ksoftirqd/1:21]")


def test_a_guest_that_powers_off_ends_the_watch(tmp_path: Path) -> None:
    out, took = watch(tmp_path, "echo done; exit 0")
    assert out.exit_reason == "poweroff" and out.lines == ["done"]
    assert took < 30  # not the 60 s timeout


def test_a_silent_guest_times_out(tmp_path: Path) -> None:
    out, _ = watch(tmp_path, "exec sleep 30", timeout_s=0.5)
    assert out.exit_reason == "timeout"


def test_qemus_own_failure_is_its_exit_code(tmp_path: Path) -> None:
    out, _ = watch(tmp_path, "echo 'qemu: could not load kernel'; exit 1")
    assert out.exit_reason == "qemu exit 1"
