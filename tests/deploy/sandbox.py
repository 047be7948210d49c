"""Run a container image's entrypoint the way a container runtime runs one Pod container, with no
container engine (none can start containers on this project's machines).

Invoked as `unshare --mount --propagation private python sandbox.py SPEC.json`: every mount lives in
that private mount namespace and goes away with the process, which execs the entrypoint (so the
Popen pid is the entrypoint's pid and signals reach it directly). SPEC is a JSON object:
  rootfs        the image's root file system (a writable container layer, e.g. `buildah mount`)
  netns         a network namespace file to enter first (hostNetwork: the node's)
  mounts        [{"target", "type": bind|tmpfs|bpf|proc|sysfs|readonly, "source", "readonly"}], in
                order ("readonly": a path already mounted made read-only in place);
                mount points are created as a runtime creates them (in the container's layer or
                inside an earlier volume), symlinks in targets resolved inside rootfs
  read_only_root  remount the root read-only after the mounts (readOnlyRootFilesystem)
  capabilities  names (NET_ADMIN, ...): the bounding set is cut to them, so the entrypoint (uid 0)
                runs with exactly these (as `capabilities: {drop: [ALL], add: [...]}`)
  no_new_privs  allowPrivilegeEscalation: false
  env, argv     the process; argv[0] is looked up on env's PATH inside the rootfs
Stdlib only: it runs before the chroot, with the host's interpreter.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "NET_BIND_SERVICE": 10, "NET_RAW": 13, "NET_ADMIN": 12,
        "SYS_ADMIN": 21, "SYS_RESOURCE": 24, "BPF": 39, "PERFMON": 38}
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def inside_root(root: Path, path: str) -> Path:
    """`path` as seen from inside `root`: symlinks (absolute ones relative to root) followed
    component by component, so a target such as /var/run/... (a symlink to /run in Debian) never
    escapes to the host's /run."""
    parts = [p for p in path.split("/") if p]
    resolved = root
    hops = 0
    while parts:
        head = parts.pop(0)
        nxt = resolved / head if head != ".." else (resolved.parent if resolved != root else root)
        if nxt.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"too many symlinks in {path}")
            link = os.readlink(nxt)
            parts = [p for p in link.split("/") if p] + parts
            resolved = root if link.startswith("/") else resolved
            continue
        resolved = nxt
    return resolved


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def make_mount_point(target: Path, source: str | None) -> None:
    if source is not None and Path(source).exists() and not Path(source).is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    else:
        target.mkdir(parents=True, exist_ok=True)


def apply_mount(root: Path, m: dict[str, Any]) -> None:
    target = inside_root(root, m["target"])
    kind, ro = m["type"], bool(m.get("readonly"))
    if kind == "readonly":  # a path already there made read-only (runc's readonlyPaths; absent: skipped)
        if target.exists():
            mount("--bind", str(target), str(target))
            mount("-o", "remount,bind,ro", str(target))
        return
    make_mount_point(target, m.get("source"))
    if kind == "bind":
        mount("--rbind", m["source"], str(target))
        if ro:
            mount("-o", "remount,bind,ro", str(target))
    else:
        opts = ["-o", "ro"] if ro else []
        mount("-t", kind, *opts, kind, str(target))


def enter_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def limit_capabilities(names: list[str], no_new_privs: bool) -> None:
    keep = {CAPS[n] for n in names}
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if cap not in keep:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    if no_new_privs:
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def find_program(root: Path, name: str, env: dict[str, str]) -> str:
    if "/" in name:
        return name
    for d in env.get("PATH", "/usr/bin:/bin").split(":"):
        if os.access(inside_root(root, f"{d}/{name}"), os.X_OK):
            return f"{d}/{name}"
    raise FileNotFoundError(f"{name} not on PATH {env.get('PATH')} in the image")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    root = Path(spec["rootfs"])
    enter_netns(spec["netns"])  # first: sysfs shows the devices of the netns that mounts it
    mount("--bind", str(root), str(root))  # the container's root, a mount of its own
    for m in spec["mounts"]:
        apply_mount(root, m)
    if spec.get("read_only_root"):
        mount("-o", "remount,bind,ro", str(root))
    program = find_program(root, spec["argv"][0], spec["env"])
    os.chroot(root)
    os.chdir("/")
    limit_capabilities(spec["capabilities"], bool(spec.get("no_new_privs")))
    os.execve(program, [program, *spec["argv"][1:]], spec["env"])


if __name__ == "__main__":
    main()
