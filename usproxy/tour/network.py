"""The tour's machine inside the machine: network namespaces, a cgroup and a BPF pin root of its
own, and their removal, also after an interrupted or killed tour.

Per mode, `TourNetwork.build()` makes two network namespaces named after the tour
(`usptour<hex>-node`, `usptour<hex>-pods`): the node (bridge usbr0 = 10.244.0.1/16, forwarding
on, where the agent and the client run) and the pods (the endpoints' addresses on a veth into
the bridge, default route via the node), as the tests and bench/ build theirs. The agent and
the client see only these namespaces' tables: the host's nftables, iptables and routes are never
touched. The tour's cgroup (under the cgroup2 mount) holds the client, so the BPF socket load
balancer, attached there, translates the client's connections and no other process's; BPF pins
go under a pin root of the tour's own (USPROXY_BPF_PINS), never the default one a real agent
uses.

Everything made is listed in a state file, /run/usproxy/tour-<hex>.json, with the tour's pid.
`close()` removes it all and the file; `sweep()`, run when a tour starts, removes what a tour
whose process is gone (kill -9) left behind. `inside(ns)` runs a block with the calling thread
in a namespace (setns is per thread), for the tour's HTTP reads of the agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from usproxy.tour.manifests import ENDPOINTS, UPDATE_ENDPOINTS
from usproxy.util import cgroup2

log = logging.getLogger(__name__)

BPFFS = Path("/sys/fs/bpf")
STATE_DIR = Path("/run/usproxy")
NODE_IP = "10.244.0.1"
PREFIX = "usptour"

NODE_SYSCTLS = (
    ("net.ipv4.ip_forward", "1"),
    ("net.ipv4.ip_local_port_range", "1024 65535"),
    ("net.core.somaxconn", "65535"),
    # short connections leave conntrack entries in TIME_WAIT (120 s by default): one second here
    # keeps tens of thousands of them from piling up during a mode (this namespace only)
    ("net.netfilter.nf_conntrack_tcp_timeout_time_wait", "1"),
)
PODS_SYSCTLS = (("net.core.somaxconn", "65535"), ("net.ipv4.tcp_max_syn_backlog", "65535"))

_SHIELD = {"depth": 0, "pending": 0}
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Clean-up that a second Ctrl-C (or SIGTERM, SIGHUP) must not cut short: such a signal is
    remembered while the block runs and raised as KeyboardInterrupt once the outermost shielded
    block is done. Main thread only (where Python runs signal handlers)."""
    def remember(signum: int, frame: object) -> None:
        _SHIELD["pending"] = signum

    outermost = _SHIELD["depth"] == 0
    old = {sig: signal.signal(sig, remember) for sig in ENDING} if outermost else {}
    _SHIELD["depth"] += 1
    try:
        yield
    finally:
        _SHIELD["depth"] -= 1
        if outermost:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            pending, _SHIELD["pending"] = _SHIELD["pending"], 0
            if pending:
                raise KeyboardInterrupt(f"signal {pending} during clean-up")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {(res.stderr or res.stdout).strip()}")
    return res


def nsexec(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`argv` in network namespace `ns` only (nsenter keeps the mounts: cgroup2 and bpffs stay
    visible, which `ip netns exec` would hide)."""
    return run("nsenter", f"--net=/run/netns/{ns}", "--", *argv, check=check)


class TourNetwork:
    """The tour's namespaces (rebuilt per mode), cgroup and pin root, and their state file."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(3)
        self.name = f"{PREFIX}{self.token}"
        self.node = f"{self.name}-node"
        self.pods = f"{self.name}-pods"
        self.cgroup = cgroup2.mount_point() / f"usproxy-tour-{self.token}"
        self.pin_root = BPFFS / f"usproxy-tour-{self.token}"
        self.state = STATE_DIR / f"tour-{self.token}.json"
        self.bpffs_was_mounted = _mount_type(BPFFS) == "bpf"
        self.namespaces: list[str] = []

    # -- the whole tour -------------------------------------------------------------------
    def open(self) -> None:
        """The cgroup and the state file (before anything else is made)."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._save()
        self.cgroup.mkdir()

    def _save(self) -> None:
        self.state.write_text(json.dumps({"pid": os.getpid(), "netns": [self.node, self.pods],
                                          "cgroup": str(self.cgroup), "pin_root": str(self.pin_root),
                                          "bpffs_was_mounted": self.bpffs_was_mounted}) + "\n")

    def close(self) -> None:
        """Remove everything: namespaces (and the processes in them), BPF programs and pins,
        the cgroup, bpffs if the tour mounted it and left it empty, the state file."""
        with shielded():
            self._close()

    def _close(self) -> None:
        self.teardown()
        remove_bpf(self.node_or_scratch(), self.cgroup, self.pin_root)
        _rmdir_cgroup(self.cgroup)
        if not self.bpffs_was_mounted:
            unmount_bpffs_if_empty()
        with contextlib.suppress(FileNotFoundError):
            self.state.unlink()

    def node_or_scratch(self) -> str | None:
        return self.node if self.node in self.namespaces else None

    # -- per mode -------------------------------------------------------------------------
    def build(self) -> None:
        """Fresh node and pods namespaces (a mode never sees another mode's kernel state)."""
        self.teardown()
        self._add(self.node)
        n = self.node
        nsexec(n, "ip", "link", "add", "usbr0", "type", "bridge")
        nsexec(n, "ip", "addr", "add", f"{NODE_IP}/16", "dev", "usbr0")
        nsexec(n, "ip", "link", "set", "usbr0", "up")
        for key, value in NODE_SYSCTLS:
            nsexec(n, "sysctl", "-qw", f"{key}={value}", check=False)
        self._add(self.pods)
        outer = f"{self.token}p0"
        nsexec(n, "ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", self.pods)
        nsexec(n, "ip", "link", "set", outer, "master", "usbr0", "up")
        for i, ip in enumerate(ENDPOINTS + UPDATE_ENDPOINTS):
            nsexec(self.pods, "ip", "addr", "add", f"{ip}/{16 if i == 0 else 32}", "dev", "eth0")
        nsexec(self.pods, "ip", "link", "set", "eth0", "up")
        nsexec(self.pods, "ip", "route", "add", "default", "via", NODE_IP)
        for key, value in PODS_SYSCTLS:
            nsexec(self.pods, "sysctl", "-qw", f"{key}={value}", check=False)

    def _add(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        nsexec(ns, "ip", "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Kill what runs in the namespaces and delete them."""
        for ns in reversed(self.namespaces):
            remove_netns(ns)
        self.namespaces.clear()


def remove_netns(ns: str) -> None:
    for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    run("ip", "netns", "del", ns, check=False)


def remove_bpf(ns: str | None, cgroup: Path, pin_root: Path) -> None:
    """Detach the programs pinned under `pin_root` and remove the pins, as a user would:
    `usproxy run --cleanup` with that pin root, in `ns` (a scratch namespace when None: its
    nftables and iptables clean-up then finds nothing)."""
    if not pin_root.exists():
        return
    scratch = None
    if ns is None:
        scratch = ns = f"{PREFIX}-clean-{secrets.token_hex(3)}"
        run("ip", "netns", "add", ns)
    try:
        env = {**os.environ, "USPROXY_BPF_PINS": str(pin_root)}
        res = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "--", sys.executable, "-m", "usproxy", "run",
                              "--cleanup", "--bpf-cgroup", str(cgroup)], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            log.warning("usproxy run --cleanup for %s: %s", pin_root, res.stderr.strip()[-500:])
        with contextlib.suppress(OSError):
            pin_root.rmdir()
    finally:
        if scratch is not None:
            run("ip", "netns", "del", scratch, check=False)


def _rmdir_cgroup(cg: Path) -> None:
    for _ in range(100):
        with contextlib.suppress(OSError):
            for pid in (cg / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    log.warning("could not remove cgroup %s", cg)


def _mount_type(path: Path) -> str | None:
    """The file system type mounted at `path` last (the one in effect), None if none."""
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[1] == str(path):
                found = parts[2]
    return found


def unmount_bpffs_if_empty() -> None:
    """bpffs at /sys/fs/bpf, mounted by the tour's BPF agent, is unmounted when nothing but the
    kernel's own iterators is in it (another program's pins keep it)."""
    if _mount_type(BPFFS) != "bpf":
        return
    preloaded = {"maps.debug", "progs.debug"}
    if not [p for p in BPFFS.iterdir() if p.name not in preloaded]:
        run("umount", str(BPFFS), check=False)


def sweep() -> list[str]:
    """Remove what earlier tours whose process is gone left (their state files say what);
    returns what was removed."""
    removed = []
    for f in sorted(STATE_DIR.glob("tour-*.json")) if STATE_DIR.is_dir() else []:
        try:
            st = json.loads(f.read_text())
            pid = int(st["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            continue
        for ns in st.get("netns", []):
            if Path(f"/run/netns/{ns}").exists():
                remove_netns(ns)
                removed.append(f"network namespace {ns}")
        pins, cg = Path(st.get("pin_root", "")), Path(st.get("cgroup", ""))
        if st.get("pin_root") and pins.exists():
            remove_bpf(None, cg, pins)
            removed.append(f"BPF pins {pins}")
        if st.get("cgroup") and cg.exists():
            _rmdir_cgroup(cg)
            removed.append(f"cgroup {cg}")
        if not st.get("bpffs_was_mounted", True):
            unmount_bpffs_if_empty()
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
