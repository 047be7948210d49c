"""Wheel build hook: the wheel carries the compiled BPF object, so `pip install usproxy-*.whl`
needs no clang.

Everything else about the package is declared in pyproject.toml; this file only extends
setuptools' build_py. After the package is copied into the build tree, the socket-LB program
(usproxy/offload/bpf/sock_lb.c) is compiled there by `usproxy.offload.bpf.build.build_prebuilt`,
under the name `object_path()` looks for (sock_lb-<sha256 prefix>.o, so an object of another
source is never used). Without clang the wheel is built without the object and says so: the
installed agent then compiles it on first use, or reports the BPF datapath unavailable with
"no clang to compile the BPF programs (apt-get install clang libbpf-dev)".
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithBpf(build_py):
    """build_py, then the BPF object compiled into build_lib's copy of usproxy/offload/bpf."""

    def run(self) -> None:
        super().run()
        if self.dry_run or getattr(self, "editable_mode", False):
            return  # an editable checkout builds it in place (python -m usproxy.offload.bpf.build)
        sys.path.insert(0, str(ROOT))  # the source tree's own build module (stdlib-only imports)
        try:
            from usproxy.util.errors import OffloadError
            from usproxy.offload.bpf import build
        finally:
            sys.path.remove(str(ROOT))
        target = Path(self.build_lib) / "usproxy" / "offload" / "bpf"
        try:
            out = build.build_prebuilt(target)
        except OffloadError as err:
            self.warn(f"BPF object not in the wheel ({err}); the agent compiles it on first use")
            return
        print(f"BPF object in the wheel: {out.relative_to(self.build_lib)}")


setup(cmdclass={"build_py": BuildPyWithBpf})
