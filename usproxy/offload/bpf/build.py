"""Compile sock_lb.c (with the xdp_lb.h it includes) into a BPF object, at set-up or on first use.

`python -m usproxy.offload.bpf.build` (the README's set-up step) writes sock_lb-<hash>.o next to
the source, named after the sha256 of the source and its headers (HEADERS); building a wheel (setup.py) puts the same object into
the wheel, so an installed wheel needs no clang. `object_path()` uses the object whose name matches the
current source and the headers it includes (HEADERS), prebuilt or in a cache directory, and
otherwise compiles into the cache, so an edited source is never served by a stale object. The flags are those found to work on this
project's machines (clang -target bpf -O2 -g, docs/platform.md#bpf); -mcpu=v3 gives the atomic
fetch-and-add the round-robin counter uses.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from usproxy.util.errors import OffloadError

SOURCE = Path(__file__).with_name("sock_lb.c")
HEADERS = ("dsr.h", "icmp_error.h", "tc_frontends.h", "xdp_lb.h")  # included by SOURCE, by name: part of what the object is named after
INCLUDE = "/usr/include/x86_64-linux-gnu"
CLANG_CANDIDATES = ("clang", "clang-16", "clang-15", "clang-14")


def source_hash() -> str:
    """sha256 of the source and the headers it includes, in that order (hex)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for name in HEADERS:
        h.update(SOURCE.with_name(name).read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("USPROXY_BPF_CACHE", str(Path(base) / "usproxy" / "bpf")))


def find_clang() -> str | None:
    for name in CLANG_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def compile_object(out: Path) -> Path:
    """Compile SOURCE into `out` (atomically: a reader never sees half an object)."""
    clang = find_clang()
    if clang is None:
        raise OffloadError("no clang to compile the BPF programs (apt-get install clang libbpf-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".o.tmp")
    os.close(fd)
    cmd = [clang, "-target", "bpf", "-O2", "-g", "-mcpu=v3", "-Wall", f"-I{INCLUDE}",
           "-c", str(SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise OffloadError(f"clang failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


def _object_name(digest: str) -> str:
    return f"sock_lb-{digest[:16]}.o"


def object_path() -> Path:
    """A BPF object built from the current source: prebuilt, cached, or compiled now."""
    override = os.environ.get("USPROXY_BPF_OBJECT")
    if override:
        return Path(override)
    name = _object_name(source_hash())
    prebuilt = SOURCE.with_name(name)
    if prebuilt.exists():
        return prebuilt
    cached = cache_dir() / name
    if cached.exists():
        return cached
    return compile_object(cached)


def build_prebuilt(directory: Path | None = None) -> Path:
    """Compile next to the source (the set-up step), or into `directory`, a copy of this package
    directory (the wheel's build tree: setup.py), under the name `object_path()` looks for there;
    drop objects of older sources. Raises OffloadError without clang or when clang fails."""
    directory = SOURCE.parent if directory is None else directory
    out = compile_object(directory / _object_name(source_hash()))
    for old in directory.glob("sock_lb-*.o"):
        if old != out:
            old.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m usproxy.offload.bpf.build",
                                     description="compile usproxy's BPF socket load balancer")
    parser.add_argument("--cache", action="store_true", help="build into the cache, not the package")
    args = parser.parse_args(argv)
    try:
        out = object_path() if args.cache else build_prebuilt()
    except OffloadError as err:
        print(f"usproxy: {err}", file=sys.stderr)
        return 1
    print(f"BPF object: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
