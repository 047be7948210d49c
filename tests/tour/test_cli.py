"""`usproxy tour`'s usage: a wrong mode or an --out that is a file is one line naming the flag
and exit 2, before anything is started; --out is required."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tour(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "usproxy", "tour", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_an_unknown_mode_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    res = tour("--modes", "relay,userspace", "--out", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "usproxy tour: --modes: unknown mode userspace (the modes: relay, iptables, ipvs, nftables, bpf)"]
    assert list(tmp_path.iterdir()) == []


def test_out_must_be_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    res = tour("--out", str(f))
    assert res.returncode == 2 and "--out" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_an_out_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    """It was a FileNotFoundError traceback (`--out /proc/nope`)."""
    f = tmp_path / "file"
    f.write_text("x")
    res = tour("--out", str(f / "sub"), "--quick")
    assert res.returncode == 2, res
    assert res.stderr.strip().splitlines() == [f"usproxy tour: --out {f / 'sub'}: cannot create: Not a directory"]


def test_out_is_required() -> None:
    res = tour("--quick")
    assert res.returncode == 2 and "--out" in res.stderr
