"""The wheel: `pip wheel` of the project gives usproxy-<version>-py3-none-any.whl carrying the BPF
object of this source (compiled at build time by setup.py), and that wheel installed into a fresh
venv (not the checkout, not the project's venv) gives a working `usproxy`: --help, explain, check.
Built without clang, the wheel still builds, says why the object is missing, and holds none.

The source is copied out of the checkout first, so the build leaves no build/ or egg-info there;
the commands run from a directory outside it, with no PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.image import ROOT
from tests.netns import Topology

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
EXAMPLES = ROOT / "examples"


def bpf_object_name() -> str:
    """The object's name: the sha256 of the source, then of every header beside it, by name."""
    bpf_dir = ROOT / "usproxy" / "offload" / "bpf"
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in [bpf_dir / "sock_lb.c", *sorted(bpf_dir.glob("*.h"))])).hexdigest()
    return f"usproxy/offload/bpf/sock_lb-{digest[:16]}.o"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def source_copy(dest: Path) -> Path:
    for name in ("pyproject.toml", "setup.py"):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "usproxy", dest / "usproxy", ignore=shutil.ignore_patterns("__pycache__", "*.o"))
    return dest


def build_wheel(src: Path, out: Path, env: dict[str, str]) -> tuple[Path, str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(src)],
                          capture_output=True, text=True, env=env, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("usproxy-*.whl")
    return wheel, proc.stdout + proc.stderr


@dataclass(frozen=True, slots=True)
class Installed:
    wheel: Path
    venv: Path
    build_log: str

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "usproxy"), *args], capture_output=True, text=True,
                              env=clean_env(), cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel, log = build_wheel(source_copy(tmp / "src"), tmp / "dist", clean_env())
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-cache-dir", "-q", str(wheel)],
                         capture_output=True, text=True, env=clean_env(), cwd=tmp, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    yield Installed(wheel, venv, log)


def test_wheel_carries_the_bpf_object_of_this_source(installed: Installed) -> None:
    assert installed.wheel.name == f"usproxy-{VERSION}-py3-none-any.whl"
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert [n for n in names if n.endswith(".o")] == [bpf_object_name()]
    assert "usproxy/offload/bpf/sock_lb.c" in names and "usproxy/py.typed" in names
    for header in sorted((ROOT / "usproxy" / "offload" / "bpf").glob("*.h")):  # part of the object's hash: object_path() reads them
        assert f"usproxy/offload/bpf/{header.name}" in names
    assert f"BPF object in the wheel: {bpf_object_name()}" in installed.build_log


def test_the_installed_wheel_runs_from_its_venv(installed: Installed, tmp_path: Path) -> None:
    where = subprocess.run([str(installed.venv / "bin" / "python"), "-c",
                            "import usproxy, usproxy.offload.bpf.build as b; print(usproxy.__file__); print(b.object_path())"],
                           capture_output=True, text=True, env=clean_env(), cwd=tmp_path, check=True).stdout.split()
    site = installed.venv / "lib"
    assert all(Path(p).is_relative_to(site) for p in where), where  # not the checkout
    assert where[1].endswith(bpf_object_name())  # the shipped object, not a compile on first use
    helptext = installed.run("--help", cwd=tmp_path)
    assert helptext.returncode == 0 and "explain" in helptext.stdout and "check" in helptext.stdout
    shown = installed.run("explain", "--services", str(EXAMPLES), "--mode", "nftables", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "10.96.10.10" in shown.stdout and "table ip kube-proxy" in shown.stdout


@pytest.mark.netns
def test_usproxy_check_from_the_wheel(installed: Installed, topology: Topology, tmp_path: Path) -> None:
    """`usproxy check` probes by creating interfaces: in a throwaway netns, never the machine's."""
    out = subprocess.run(["ip", "netns", "exec", topology.node, str(installed.venv / "bin" / "usproxy"), "check"],
                         capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nftables" in out.stdout and "bpf" in out.stdout


@pytest.mark.netns
def test_check_from_the_wheel_needs_no_clang(installed: Installed, topology: Topology, tmp_path: Path) -> None:
    """On a node without clang (the image, an edge device), `usproxy check` and the agent agree:
    the wheel's prebuilt object serves, so BPF is available. nsenter keeps /sys (cgroup v2)."""
    assert installed.run("--help", cwd=tmp_path).returncode == 0
    env = clean_env(PATH=f"{installed.venv / 'bin'}:/usr/sbin:/sbin")  # clang lives in /usr/bin
    out = subprocess.run(["/usr/bin/nsenter", f"--net=/run/netns/{topology.node}",
                          str(installed.venv / "bin" / "usproxy"), "check"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("bpf cgroup hooks"))
    assert row.split()[3] == "yes" and "clang" not in row, out.stdout


def test_without_clang_the_wheel_builds_without_the_object_and_says_why(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"  # a PATH holding the interpreter and nothing else (no clang)
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    wheel, log = build_wheel(source_copy(tmp_path / "src"), tmp_path / "dist", clean_env(PATH=str(bindir)))
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".o")]
    assert "BPF object not in the wheel (no clang to compile the BPF programs" in log
