"""Root file systems for the lab's guests, built once per architecture and cached.

What a built root holds: Debian bookworm (debootstrap --variant=minbase, from the mirror apt uses on
this machine), Debian's 6.1 kernel with its modules (linux-image-cloud-amd64 or linux-image-arm64,
installed by dpkg, so `modprobe` and `uname -r` are a Debian node's), nftables, iptables, ipvsadm,
conntrack, iproute2, python3 and a venv at /opt/usproxy holding pip, usproxy's dependencies and the
test tools (pytest, pytest-asyncio, hypothesis) from PyPI wheels of the guest's architecture.
usproxy's own wheel is not in it: each boot installs the wheel of the current source
(machine.py), so a source change never needs a rebuild.

One way for both architectures, nothing booted:
1. debootstrap's first stage (--foreign) on the host: downloads the packages, unpacks the
   essential ones;
2. its second stage (dpkg installing and configuring every package) in a chroot of the root:
   natively on amd64, through qemu-user on arm64 (foreign.py). Before it, the Packages index the
   second stage parses is cut to the packages being installed (debootstrap reads all 49 MB of it
   with perl, which under emulation took three minutes), and dpkg skips its fsyncs (the image is
   written afterwards by mkfs; the setting is removed again);
3. the venv: `python3 -m venv --without-pip` in the chroot, then the host's pip installs the wheels
   into its site-packages (`pip install --target --platform ...`: wheels are files, no guest code
   runs), and the scripts pip wrote get the venv's interpreter;
4. the kernel, busybox and the boot modules copied out; docs, man pages and apt's lists dropped;
   the tree written as an ext4 image by `mkfs.ext4 -d` (no mount, no loop device).

Cache: USPROXY_LAB_CACHE (default /var/cache/usproxy-lab)/<arch>-<key>/ with rootfs.img (ext4,
sparse), vmlinuz, boot/ (busybox and the virtio modules the lab's initramfs loads) and info.json,
written last: a directory without info.json is a build that did not finish and is rebuilt. The
key hashes the suite, architecture, mirror, package list, Python requirements and BUILD_VERSION;
roots of other keys (other branches' requirements) are kept beside it. Kept 30 days; `--fresh`
rebuilds.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from lab import foreign
from lab.scenarios import Arch

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("USPROXY_LAB_CACHE", "/var/cache/usproxy-lab"))
SUITE = "bookworm"
BUILD_VERSION = 2  # bump when the build steps change what a root holds
MAX_AGE_DAYS = 30
PACKAGES = ("kmod", "iproute2", "nftables", "iptables", "ipvsadm", "conntrack", "procps", "psmisc",
            "python3", "libbpf1", "busybox-static", "util-linux")
KERNEL_PACKAGE: dict[Arch, str] = {"amd64": "linux-image-cloud-amd64", "arm64": "linux-image-arm64"}
PIP_MACHINE: dict[Arch, str] = {"amd64": "x86_64", "arm64": "aarch64"}
TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.23", "hypothesis>=6")
GUEST_TOOLS = ("pip",)  # the guest's init installs usproxy's wheel with it
VENV = "/opt/usproxy"
PYTHON_VERSION = "3.11"  # bookworm's python3
# what the lab's initramfs loads to reach the root disk, with what they depend on (modules.dep);
# a module built into a kernel (ext4 on amd64, not on arm64) has no file and is skipped
BOOT_MODULES = ("virtio_mmio", "virtio_pci", "virtio_blk", "crc32c_generic", "ext4")
HEADROOM_MIB = 1536  # free space in the image for what a guest writes (its writes go to an overlay)
DPKG_UNSAFE_IO = "etc/dpkg/dpkg.cfg.d/usproxy-lab-build"  # present only while the build runs dpkg


@dataclass(frozen=True, slots=True)
class Rootfs:
    arch: Arch
    directory: Path

    @property
    def image(self) -> Path:
        return self.directory / "rootfs.img"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def boot(self) -> Path:
        return self.directory / "boot"

    def info(self) -> dict[str, object]:
        return dict(json.loads((self.directory / "info.json").read_text()))


def log(msg: str) -> None:
    print(f"lab: {msg}", file=sys.stderr, flush=True)


def mirrors() -> tuple[str, str]:
    """The Debian mirror and security mirror apt uses here (deb822 .sources or one-line .list)."""
    found: dict[str, str] = {}

    def note(uris: list[str], suites: list[str]) -> None:
        for s in suites:
            for u in uris:
                found.setdefault(s, u.rstrip("/"))

    for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
        for stanza in re.split(r"\n\s*\n", Path(path).read_text()):
            fields = {k.strip().lower(): v.split() for k, v in re.findall(r"^([\w-]+):(.*)$", stanza, re.M)}
            if "deb" in fields.get("types", []) and fields.get("enabled", ["yes"]) != ["no"]:
                note(fields.get("uris", []), fields.get("suites", []))
    for path in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
            if len(words) >= 3 and words[0] == "deb":
                note([words[1]], [words[2]])
    return (found.get(SUITE, "http://deb.debian.org/debian"),
            found.get(f"{SUITE}-security", "http://deb.debian.org/debian-security"))


def requirements() -> list[str]:
    """usproxy's runtime dependencies (pyproject.toml), the test tools a `--run` needs, and pip."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *TEST_TOOLS, *GUEST_TOOLS]


def cache_key(arch: Arch) -> str:
    mirror, _ = mirrors()
    parts = [SUITE, arch, mirror, *PACKAGES, KERNEL_PACKAGE[arch], *requirements(), str(BUILD_VERSION)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def cached(arch: Arch) -> Rootfs | None:
    """The cached root for `arch` if it is complete and young enough."""
    root = Rootfs(arch, CACHE / f"{arch}-{cache_key(arch)}")
    info = root.directory / "info.json"
    if info.exists() and time.time() - info.stat().st_mtime < MAX_AGE_DAYS * 86400 and root.image.exists():
        return root
    return None


def ensure(arch: Arch, fresh: bool = False) -> Rootfs:
    """The root for `arch`: cached, or built now (minutes; the log says which step runs). One
    build per architecture at a time on this machine: a second caller waits and takes its result."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f".lock-{arch}").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not fresh:
            found = cached(arch)
            if found is not None:
                return found
        return build(arch)


def run(cmd: list[str], log_to: Path, env: dict[str, str] | None = None, timeout: float = 3600,
        launcher: foreign.Launcher | None = None) -> None:
    """cmd with its output appended to log_to; on failure, raise with the log's tail. It runs in a
    process group of its own, killed whole if the build is interrupted (debootstrap's wget and
    dpkg would otherwise go on writing into a directory being removed). `launcher`: how a command
    that runs the root's programs is started (foreign.py)."""
    if launcher is not None:
        cmd = [*launcher.prefix, *cmd]
        env = {**(env or os.environ), **launcher.env}
    with log_to.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if launcher is not None and launcher.on_start is not None:
                launcher.on_start(proc)
            code = proc.wait(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        tail = "\n".join(log_to.read_text().splitlines()[-25:])
        raise RuntimeError(f"{cmd[0]} failed (exit {code}):\n{tail}")


def pip_download(arch: Arch, dest: Path, log_to: Path) -> None:
    """Wheels of every requirement for the guest's Python (3.11, glibc 2.36) and architecture."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = dest / "requirements.txt"
    reqs.write_text("\n".join(requirements()) + "\n")
    run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", *platform_args(arch),
         "-d", str(dest), "-r", str(reqs)], log_to, timeout=900)


def platform_args(arch: Arch) -> list[str]:
    """pip's options for wheels the guest's Python (3.11, glibc 2.36, arch) can load, and nothing to build."""
    m = PIP_MACHINE[arch]
    # pip expands none of these to the others: name each tag a wheel of glibc <= 2.36 may carry
    tags = ("manylinux2014", "manylinux_2_17", "manylinux_2_28", "manylinux_2_31", "manylinux_2_34")
    return ["--only-binary=:all:", *[a for tag in tags for a in ("--platform", f"{tag}_{m}")],
            "--python-version", PYTHON_VERSION, "--implementation", "cp"]


def slim(root: Path) -> None:
    """What a node does not need and the image would carry: docs, man pages, locales, apt's cache."""
    for sub in ("usr/share/doc", "usr/share/man", "usr/share/locale", "usr/share/info", "var/cache/apt",
                "var/lib/apt/lists"):
        target = root / sub
        if target.is_dir():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def chroot_env() -> dict[str, str]:
    # nothing of the host's environment (its pip configuration, locale, proxies) leaks in
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PIP_CONFIG_FILE": "/dev/null",
            "DEBIAN_FRONTEND": "noninteractive", "INITRD": "No"}


def trim_index(root: Path) -> None:
    """Cut the Packages index the second stage reads to the packages the first stage chose
    (debootstrap/required and base): the second stage parses the whole index several times."""
    names = set((root / "debootstrap/required").read_text().split()) | set((root / "debootstrap/base").read_text().split())
    for index in (root / "var/lib/apt/lists").glob("*_Packages"):
        stanzas = index.read_text().split("\n\n")
        keep = [st for st in stanzas if (m := re.match(r"Package: (\S+)", st)) and m.group(1) in names]
        index.write_text("\n\n".join(keep) + "\n")


def second_stage(root: Path, launcher: foreign.Launcher, log_to: Path) -> None:
    trim_index(root)
    (root / DPKG_UNSAFE_IO).parent.mkdir(parents=True, exist_ok=True)
    (root / DPKG_UNSAFE_IO).write_text("force-unsafe-io\n")
    run(["chroot", str(root), "/debootstrap/debootstrap", "--second-stage"], log_to, env=chroot_env(),
        launcher=launcher)
    (root / DPKG_UNSAFE_IO).unlink()


def make_venv(root: Path, arch: Arch, wheels: Path, launcher: foreign.Launcher, log_to: Path) -> None:
    """The venv at VENV, made by the root's python3; its packages installed by the host's pip."""
    run(["chroot", str(root), "python3", "-m", "venv", "--without-pip", VENV], log_to, env=chroot_env(),
        launcher=launcher)
    venv = root / VENV.lstrip("/")
    (site,) = venv.glob("lib/python3*/site-packages")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", "PIP_CONFIG_FILE": "/dev/null"}
    run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index", "--find-links",
         str(wheels), *platform_args(arch), "--target", str(site), "-r", str(wheels / "requirements.txt")], log_to,
        env=env)
    # --target puts the scripts in site-packages/bin, started by the host's interpreter
    for script in sorted((site / "bin").iterdir()):
        lines = script.read_bytes().split(b"\n", 1)
        if lines[0].startswith(b"#!") and b"python" in lines[0] and len(lines) == 2:
            script.write_bytes(f"#!{VENV}/bin/python3\n".encode() + lines[1])
        shutil.move(script, venv / "bin" / script.name)
    (site / "bin").rmdir()


def boot_files(root: Path, into: Path) -> str:
    """Copy the kernel, busybox and BOOT_MODULES for the initramfs into `into`; returns the kernel
    version."""
    (kernel,) = sorted((root / "boot").glob("vmlinuz-*"))[-1:]
    version = kernel.name.removeprefix("vmlinuz-")
    (into / "boot").mkdir(parents=True, exist_ok=True)
    shutil.copy(kernel, into / "vmlinuz")
    shutil.copy(root / "bin" / "busybox", into / "boot" / "busybox")
    modules = boot_modules(root / "lib" / "modules" / version, version)
    for ko in modules:
        shutil.copy(ko, into / "boot" / ko.name)
    (into / "boot" / "modules.order").write_text(" ".join(ko.name.split(".ko")[0] for ko in modules) + "\n")
    return version


def boot_modules(moddir: Path, version: str) -> list[Path]:
    """BOOT_MODULES' files and what they depend on, each after what it needs (insmod order). The
    dependencies are read from each module's own .modinfo ("depends=a,b"), so this works on a
    foreign architecture's modules, before depmod ever ran."""
    files = {ko.name.split(".ko")[0].replace("-", "_"): ko for ko in (moddir / "kernel").rglob("*.ko")}
    order: list[Path] = []

    def visit(name: str) -> None:
        ko = files.get(name)
        if ko is None or ko in order:
            return  # built in, or already placed
        found = re.search(rb"depends=([^\0]*)", ko.read_bytes())
        for dep in (found.group(1).decode().split(",") if found else []):
            if dep:
                visit(dep.replace("-", "_"))
        order.append(ko)

    for name in BOOT_MODULES:
        visit(name)
    return order


def make_image(root: Path, image: Path, log_to: Path, headroom_mib: int = HEADROOM_MIB) -> None:
    used = int(subprocess.run(["du", "-sm", "--apparent-size", str(root)], check=True, capture_output=True,
                              text=True).stdout.split()[0])
    with image.open("wb") as f:
        f.truncate((used + headroom_mib) * 1024 * 1024)
    run(["mkfs.ext4", "-q", "-F", "-L", "usproxy-lab", "-d", str(root), str(image)], log_to)


def build(arch: Arch) -> Rootfs:
    start = time.monotonic()
    key = cache_key(arch)
    final = CACHE / f"{arch}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{arch}-", dir=CACHE))
    log_to = work / "build.log"
    steps: dict[str, float] = {}

    def step(name: str, t: float) -> None:
        steps[name] = round(time.monotonic() - t, 1)

    try:
        mirror, _ = mirrors()
        root = work / "root"
        t = time.monotonic()
        log(f"pip download: wheels for {PIP_MACHINE[arch]}; log {log_to}")
        pip_download(arch, work / "wheels", log_to)
        step("pip_download_s", t)
        t = time.monotonic()
        log(f"debootstrap {SUITE} {arch}, first stage, from {mirror}")
        run(["debootstrap", "--variant=minbase", f"--arch={arch}", "--foreign",
             f"--include={','.join((*PACKAGES, KERNEL_PACKAGE[arch]))}", SUITE, str(root), mirror], log_to,
            env={**os.environ, "INITRD": "No", "DEBIAN_FRONTEND": "noninteractive"})
        step("first_stage_s", t)
        with foreign.launcher_for(arch, log) as launcher:
            t = time.monotonic()
            log(f"debootstrap second stage in a chroot ({launcher.mode})")
            second_stage(root, launcher, log_to)
            step("second_stage_s", t)
            t = time.monotonic()
            make_venv(root, arch, work / "wheels", launcher, log_to)
            step("venv_s", t)
        t = time.monotonic()
        version = boot_files(root, work)
        slim(root)
        make_image(root, work / "rootfs.img", log_to)
        shutil.rmtree(root)
        step("image_s", t)
        info = {"arch": arch, "suite": SUITE, "kernel": version, "mirror": mirror, "key": key,
                "packages": [*PACKAGES, KERNEL_PACKAGE[arch]], "requirements": requirements(),
                "emulation": launcher.mode, "steps": steps, "built_s": round(time.monotonic() - start, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / "info.json").write_text(json.dumps(info, indent=1))
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)  # whole or absent under the cached name
        # other roots of this architecture stay while young: worktrees of other branches (other
        # requirements, another key) use them, maybe right now
        for old in CACHE.glob(f"{arch}-*"):
            if old != final and time.time() - old.stat().st_mtime > MAX_AGE_DAYS * 86400:
                shutil.rmtree(old, ignore_errors=True)
        log(f"{arch} root built in {time.monotonic() - start:.0f} s ({steps}): {final}")
        return Rootfs(arch, final)
    except BaseException:
        kept = CACHE / f"failed-{arch}.log"
        if log_to.exists():
            shutil.copy(log_to, kept)
            log(f"build failed; its log is {kept}")
        raise
    finally:
        if work.exists():
            subprocess.run(["rm", "-rf", str(work)])
