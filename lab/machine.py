"""One guest boot: qemu with Debian's kernel, the lab's initramfs, the cached root image behind a
throwaway overlay, an input disk and an output disk; no network device at all.

Disks, in this order (so the guest sees vda, vdb, vdc):
- vda: the root image (rootfs.py), opened with snapshot=on: the guest writes to a temporary
  overlay in this run's directory, the cached image is never changed;
- vdb: a tar of what this run brings in (lab/guest, usproxy's wheel, params.json and, for
  --run, the repository), unpacked by the initramfs into /lab of the root;
- vdc: zeros; the guest writes a tar of /lab/out onto it before it powers off, and the host
  unpacks it: results, the agent's log, dmesg.

The initramfs is busybox plus the virtio modules (copied from the root at build time): it loads
them, mounts vda, unpacks vdb and switches to /lab/guest/init.sh on the root. The serial console
is streamed to stderr (prefixed "guest: ") and kept in console.log.

Acceleration: TCG (software emulation) unless KVM is shown to work here: a tiny boot under KVM
must print its marker within KVM_PROBE_S; the answer is remembered per host boot. On this
project's machines KVM guests die ("KVM internal error", nested virtualization), so TCG it is.

A guest whose kernel reports a soft lockup of LOCKUP_GIVE_UP_S seconds or more on its console
is given up at once ("locked up: " and that line) rather than at the timeout: it does not come
back, and 15 minutes of a CI run went to one (an ipvs guest under TCG, 2026-12-06). Shorter
reports are only noted: under an emulator on a loaded host the watchdog can report a stall the
guest comes out of.

Teardown: qemu is killed and the run's directory removed whatever happens (timeout, an exception,
SIGINT, SIGTERM, SIGHUP); `run()` installs handlers that turn the signals into an exception.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from lab.rootfs import CACHE, Rootfs, log
from lab.scenarios import Arch

OUTPUT_DISK_MIB = 128
LOCKUP_GIVE_UP_S = 120  # a CPU stuck this long in the guest's kernel: it is hung
_LOCKUP = re.compile(r"soft lockup - CPU#\d+ stuck for (\d+)s!")
KVM_PROBE_S = 20.0
INIT = """#!/bin/busybox sh
# the lab's initramfs: reach the root disk, bring this run's files in, hand over to the root
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /boot-modules); do [ -f /mods/$m.ko ] && insmod /mods/$m.ko 2>/dev/null; done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mode=run
for word in $(cat /proc/cmdline); do case "$word" in lab.mode=*) mode=${word#lab.mode=} ;; esac; done
if [ "$mode" = probe ]; then echo "lab-kvm-probe-ok"; poweroff -f; fi
mount -t ext4 -o rw /dev/vda /newroot || { echo "lab: cannot mount the root disk"; poweroff -f; }
mkdir -p /newroot/lab
tar -xf /dev/vdb -C /newroot/lab || { echo "lab: cannot unpack the input disk"; poweroff -f; }
umount /proc /sys /dev
exec switch_root /newroot /bin/sh /lab/guest/init.sh
"""


@dataclass(frozen=True, slots=True)
class Boot:
    """What one boot needs besides the root: vCPUs, memory, extra kernel arguments."""
    arch: Arch
    smp: int
    memory_mib: int
    append: tuple[str, ...] = ()
    timeout_s: float = 900.0


@dataclass
class Outcome:
    exit_reason: str  # "poweroff", "timeout", "qemu exit N", "locked up: <the console's line>"
    wall_s: float
    accel: str
    console: Path
    output: Path | None = None
    lines: list[str] = field(default_factory=list)


class Interrupted(Exception):
    """A signal asked the lab to stop; raised on the main thread so `finally` blocks tear down."""


_held: list[str] = []  # signals that came while `signals_held` held them (at most: the first)
_holding = False


@contextmanager
def signals_raise() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        if _holding:
            _held[:] = _held or [signal.Signals(signum).name]
            return
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def hold_signals() -> None:
    """Hold signals_raise's signals while a child starts (a Popen left half way leaves its child
    running with no one to kill it) until `release_signals`."""
    global _holding
    _holding = True


def release_signals() -> None:
    """Stop holding, and raise a signal that came meanwhile as Interrupted."""
    global _holding
    _holding = False
    if _held:
        raise Interrupted(_held.pop())


def build_initramfs(root: Rootfs | Path, dest: Path) -> Path:
    """busybox + the virtio modules + INIT, as a newc cpio (uncompressed: built per run in ~0.1 s)."""
    boot = root.boot if isinstance(root, Rootfs) else root / "boot"
    tree = dest / "initramfs"
    (tree / "bin").mkdir(parents=True)
    (tree / "mods").mkdir()
    shutil.copy(boot / "busybox", tree / "bin" / "busybox")
    for ko in boot.glob("*.ko*"):
        shutil.copy(ko, tree / "mods" / ko.name)
    shutil.copy(boot / "modules.order", tree / "boot-modules")
    (tree / "init").write_text(INIT)
    (tree / "init").chmod(0o755)
    out = dest / "initramfs.cpio"
    files = subprocess.run(["find", "."], cwd=tree, check=True, capture_output=True).stdout
    with out.open("wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, input=files, stdout=f, check=True)
    shutil.rmtree(tree)
    return out


def qemu_command(boot: Boot, kernel: Path, initrd: Path, drives: list[tuple[Path, bool]], accel: str) -> list[str]:
    """drives: (file, snapshot) in vda, vdb, vdc order."""
    console = "ttyS0" if boot.arch == "amd64" else "ttyAMA0"
    append = " ".join((f"console={console}", "panic=-1", "loglevel=4", *boot.append))
    if boot.arch == "amd64":
        cmd = ["qemu-system-x86_64", "-cpu", "max" if accel == "tcg" else "host"]
    else:
        # cortex-a57: an ARMv8.0 board; "max" adds pointer authentication, which TCG emulates slowly
        cmd = ["qemu-system-aarch64", "-M", "virt", "-cpu", "cortex-a57"]
    cmd += ["-accel", accel, "-smp", str(boot.smp), "-m", str(boot.memory_mib), "-nodefaults", "-no-user-config",
            "-display", "none", "-nic", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initrd), "-append", append]
    for path, snapshot in drives:
        cmd += ["-drive", f"file={path},format=raw,if=virtio,cache=unsafe" + (",snapshot=on" if snapshot else "")]
    return cmd


def boot_once(cmd: list[str], workdir: Path, timeout_s: float, quiet: bool = False) -> Outcome:
    """Run qemu until it exits or timeout_s passes; stream its console. Kills qemu on the way out."""
    console = workdir / "console.log"
    start = time.monotonic()
    env = {**os.environ, "TMPDIR": str(workdir)}  # snapshot=on overlays land here, removed with it
    hold_signals()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env)
    except BaseException:
        release_signals()
        raise
    try:  # from here on: a signal (Interrupted) anywhere, even before the wait, kills qemu
        release_signals()
        return _watch(proc, console, start, cmd[cmd.index("-accel") + 1], timeout_s, quiet)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _watch(proc: subprocess.Popen[bytes], console: Path, start: float, accel: str, timeout_s: float,
           quiet: bool) -> Outcome:
    """boot_once's wait for `proc` (qemu), with its console streamed to `console`, until it
    exits, timeout_s passes or the guest's kernel reports a lockup of LOCKUP_GIVE_UP_S."""
    lines: list[str] = []
    wake = threading.Event()  # the console ended (qemu exits) or reported a lockup
    hung_line: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        with console.open("w", errors="replace") as out:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\r\n")
                out.write(line + "\n")
                out.flush()
                lines.append(line)
                if not quiet:
                    print(f"guest: {line}", file=sys.stderr, flush=True)
                if not hung_line and locked_up(line):
                    hung_line.append(line.strip())
                    wake.set()
        wake.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if wake.wait(timeout=timeout_s) and hung_line and proc.poll() is None:
            reason = f"locked up: {hung_line[0]}"
        else:
            code = proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
            reason = "poweroff" if code == 0 else f"qemu exit {code}"
    except subprocess.TimeoutExpired:
        reason = "timeout"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    return Outcome(reason, round(time.monotonic() - start, 1), accel, console, lines=lines)


def locked_up(line: str) -> bool:
    """Whether a console line is the kernel's report of a CPU stuck LOCKUP_GIVE_UP_S or more."""
    m = _LOCKUP.search(line)
    return m is not None and int(m.group(1)) >= LOCKUP_GIVE_UP_S


def kvm_works(root: Rootfs) -> bool:
    """Whether a KVM guest boots here: tried once per host boot, the answer cached."""
    if root.arch != "amd64" or platform.machine() != "x86_64" or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    memo = CACHE / f"kvm-{boot_id}"
    if memo.exists():
        return memo.read_text().strip() == "yes"
    with tempfile.TemporaryDirectory(prefix="usproxy-lab-kvm-") as tmp:
        work = Path(tmp)
        initrd = build_initramfs(root, work)
        cmd = qemu_command(Boot("amd64", 1, 256, ("lab.mode=probe",)), root.kernel, initrd, [], "kvm")
        out = boot_once(cmd, work, KVM_PROBE_S, quiet=True)
        ok = any("lab-kvm-probe-ok" in line for line in out.lines)
    for old in CACHE.glob("kvm-*"):
        old.unlink(missing_ok=True)
    memo.write_text("yes\n" if ok else "no\n")
    log(f"KVM {'works' if ok else 'does not work'} here ({'kvm' if ok else 'tcg'} from now on, until the host reboots)")
    return ok


def input_disk(workdir: Path, members: dict[str, Path]) -> Path:
    """A tar of members (name in the guest's /lab -> host path), padded to whole sectors."""
    disk = workdir / "input.tar"
    with tarfile.open(disk, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, path in members.items():
            tar.add(path, arcname=name, filter=_strip_caches)
    size = disk.stat().st_size
    with disk.open("ab") as f:
        f.write(b"\0" * (-size % 512 + 1024 * 1024))  # and a zero tail: tar stops at its end marker
    return disk


def _strip_caches(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = Path(info.name).name
    if name in ("__pycache__", ".mypy_cache", ".pytest_cache", ".hypothesis") or name.endswith((".pyc", ".o")):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def output_disk(workdir: Path) -> Path:
    disk = workdir / "output.img"
    with disk.open("wb") as f:
        f.truncate(OUTPUT_DISK_MIB * 1024 * 1024)
    return disk


def read_output(disk: Path, dest: Path) -> bool:
    """Unpack the tar the guest wrote; False when it wrote none (it never got that far)."""
    with disk.open("rb") as f:
        if not f.read(512).strip(b"\0"):
            return False
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(disk, "r:") as tar:
        tar.extractall(dest, filter="data")
    return True


def run(root: Rootfs, boot: Boot, members: dict[str, Path], results: Path) -> Outcome:
    """Boot once with `members` on the input disk; the guest's /lab/out lands in `results`."""
    work = Path(tempfile.mkdtemp(prefix="usproxy-lab-", dir="/var/tmp"))
    try:
        with signals_raise():
            accel = "kvm" if kvm_works(root) else "tcg"
            initrd = build_initramfs(root, work)
            drives = [(root.image, True), (input_disk(work, members), False), (output_disk(work), False)]
            cmd = qemu_command(boot, root.kernel, initrd, drives, accel)
            log(f"booting {boot.arch} ({accel}, {boot.smp} vCPU, {boot.memory_mib} MiB): {' '.join(boot.append)}")
            out = boot_once(cmd, work, boot.timeout_s)
            results.mkdir(parents=True, exist_ok=True)
            shutil.copy(out.console, results / "console.log")
            out.console = results / "console.log"
            if read_output(work / "output.img", results / "guest"):
                out.output = results / "guest"
            return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
