"""Running a root file system's own programs in a chroot while it is built (rootfs.py): natively
for amd64, through qemu-user for arm64, with no emulated machine.

arm64's programs run under qemu-aarch64-static (Debian's qemu-user-static) by way of a binfmt_misc
handler: Debian's own definition (/usr/lib/binfmt.d/qemu-aarch64.conf) under a name of the lab's,
with the F flag, so the kernel opens the interpreter when the handler is registered and it need
not exist inside the chroot. Where the handler lives:

- "private" (the default where the kernel allows it, Linux 6.7 and later): each command runs in a
  user namespace of its own, with uids and gids mapped one to one (files keep their owners), its
  own mount, PID and network namespaces, and a binfmt_misc instance mounted inside it, which only
  that namespace sees. The handler is registered there and goes away with the command: nothing
  changes machine-wide. Device nodes cannot be made in a user namespace: debootstrap is told it
  runs in a container (container=lxc) and keeps the ones its first stage made.
- "machine" (older kernels, or USPROXY_LAB_BINFMT=machine): the handler is registered in the
  machine's binfmt_misc (mounted at /proc/sys/fs/binfmt_misc if it is not) for the build only:
  while it is registered, every aarch64 program started on this machine runs through qemu. It is
  removed when the build's emulated steps end, even on error or interruption, and binfmt_misc is
  unmounted again if the build mounted it. One build at a time holds it (a lock in /run).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lab.scenarios import Arch

BINFMT = Path("/proc/sys/fs/binfmt_misc")
DEBIAN_HANDLER: dict[Arch, Path] = {"arm64": Path("/usr/lib/binfmt.d/qemu-aarch64.conf")}
QEMU_USER: dict[Arch, str] = {"arm64": "qemu-aarch64-static"}
NAME = "usproxy-lab-{arch}"
MACHINE_LOCK = Path("/run/usproxy-lab-binfmt.lock")
IDENTITY_MAP = "0 0 4294967295\n"
# PID 1 of a private namespace: wait for the host to map the ids, mount proc and a binfmt_misc of
# the namespace's own, register the handler, run the command
PRIVATE_INIT = r"""
until [ -n "$(cat /proc/self/uid_map)" ]; do sleep 0.02; done
mount -t proc proc /proc || exit 97
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || exit 97
printf '%s' "$LAB_BINFMT" > /proc/sys/fs/binfmt_misc/register || exit 97
exec "$@"
"""


class ForeignError(RuntimeError):
    """The build cannot run the foreign architecture's programs here."""


@dataclass(frozen=True, slots=True)
class Launcher:
    """How a command is started so that the root's programs run: `prefix` goes before the command,
    `env` is added to its environment, and `on_start` is called with the process once started."""
    prefix: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None
    mode: str = "native"


def handler(arch: Arch) -> str:
    """Debian's binfmt_misc line for `arch`, under the lab's name and with the F flag."""
    conf = DEBIAN_HANDLER[arch]
    if shutil.which(QEMU_USER[arch]) is None or not conf.exists():
        raise ForeignError(f"{QEMU_USER[arch]} missing: building the {arch} root needs qemu-user-static "
                           f"(bash scripts/setup.sh installs it)")
    fields = conf.read_text().strip().split(":")  # :name:type:offset:magic:mask:interpreter:flags
    if len(fields) != 8:
        raise ForeignError(f"{conf}: not a binfmt_misc line")
    fields[1] = NAME.format(arch=arch)
    fields[7] = fields[7] if "F" in fields[7] else fields[7] + "F"
    return ":".join(fields)


def map_ids(proc: subprocess.Popen[bytes]) -> None:
    """Map the new user namespace's ids one to one, once `proc` is in it (unshare(1) makes it
    just after it starts). Root outside may map any range; newuidmap would want /etc/subuid."""
    mine = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + 10
    while os.readlink(f"/proc/{proc.pid}/ns/user") == mine:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ForeignError("unshare did not make a user namespace")
        time.sleep(0.005)
    for name in ("uid_map", "gid_map"):
        Path(f"/proc/{proc.pid}/{name}").write_text(IDENTITY_MAP)


def private_launcher(arch: Arch) -> Launcher:
    prefix = ("unshare", "--user", "--mount", "--pid", "--net", "--fork", "--kill-child", "sh", "-c", PRIVATE_INIT,
              "lab-ns")
    return Launcher(prefix, {"LAB_BINFMT": handler(arch), "container": "lxc"}, map_ids, "private")


def private_works(arch: Arch) -> bool:
    """Whether a user namespace can have its own binfmt_misc here (Linux 6.7+): tried with `true`."""
    launcher = private_launcher(arch)
    proc = subprocess.Popen([*launcher.prefix, "true"], env={**os.environ, **launcher.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        map_ids(proc)
        return proc.wait(timeout=60) == 0
    except (ForeignError, OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
        return False


@contextmanager
def machine_handler(arch: Arch, log: Callable[[str], None]) -> Iterator[None]:
    """The handler in the machine's binfmt_misc for the duration of the block, then removed."""
    line = handler(arch)
    MACHINE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with MACHINE_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mounted = False
        if not (BINFMT / "register").exists():
            subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True)
            mounted = True
        entry = BINFMT / NAME.format(arch=arch)
        log(f"registering {entry.name} in the machine's binfmt_misc for this build: until it ends, every "
            f"{arch} program on this machine runs through {QEMU_USER[arch]}")
        try:
            if not entry.exists():  # else a build killed before it could remove it: ours, by its name
                (BINFMT / "register").write_text(line)
            yield
        finally:
            if entry.exists():
                entry.write_text("-1")
            if mounted:
                subprocess.run(["umount", str(BINFMT)], check=False)
            log(f"{entry.name} removed from the machine's binfmt_misc")


@contextmanager
def launcher_for(arch: Arch, log: Callable[[str], None]) -> Iterator[Launcher]:
    """How to run the `arch` root's programs on this host, for the duration of the block."""
    if arch == "amd64":
        yield Launcher()
        return
    wanted = os.environ.get("USPROXY_LAB_BINFMT", "")
    if wanted not in ("", "private", "machine"):
        raise ForeignError(f"USPROXY_LAB_BINFMT={wanted!r}: private or machine")
    if wanted != "machine":
        if private_works(arch):
            log(f"{arch} programs run through {QEMU_USER[arch]}, registered in a private binfmt_misc")
            yield private_launcher(arch)
            return
        if wanted == "private":
            raise ForeignError("a user namespace cannot have its own binfmt_misc on this kernel (Linux 6.7+)")
    with machine_handler(arch, log):
        yield Launcher(mode="machine")
