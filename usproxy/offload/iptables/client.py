"""IptablesClient: runs the iptables tools in the datapath's network namespace, off the loop.

Every command runs in one dedicated worker thread (NetnsWorker), which first enters `netns` when
one is given: a child process forked from that thread starts in the thread's network namespace,
so the tools program it without `ip netns exec` (which would also remount /sys). The same thread
makes the nfacct counters and writes the namespace's sysctls. Calls run one at a time, in order.
A command that fails raises OffloadError with the tool's own message (iptables-restore names the
line it refused); a restore that fails changes nothing of its table.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from usproxy.offload.iptables import nfacct
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.util.errors import OffloadError

T = TypeVar("T")
TIMEOUT = 120.0  # seconds; a restore of 10,000 Services takes a few


class IptablesTransport(Protocol):
    """What the datapath needs from IptablesClient, or from its fake (fake.FakeIptablesClient)."""

    async def run(self, argv: Sequence[str], stdin: str | None = None) -> str: ...

    def run_sync(self, argv: Sequence[str], stdin: str | None = None) -> str | None: ...

    async def ensure_nfacct(self) -> str | None: ...

    async def sysctl(self, path: str, value: str | None = None) -> str | None: ...

    def close(self) -> None: ...


class IptablesClient:
    """The iptables tools, nfacct and sysctls of one network namespace (None: the agent's own)."""

    def __init__(self, netns: str | None = None) -> None:
        self._worker = NetnsWorker("iptables", netns)

    async def run(self, argv: Sequence[str], stdin: str | None = None) -> str:
        """`argv`'s stdout; OffloadError when it cannot run or fails."""
        return await self._worker.run(run_command, list(argv), stdin)

    def run_sync(self, argv: Sequence[str], stdin: str | None = None) -> str | None:
        """`argv`'s stdout, None when it fails; blocks the caller (probes, at start)."""
        try:
            return self._worker.call(run_command, list(argv), stdin, timeout=TIMEOUT)
        except (OffloadError, TimeoutError):
            return None

    async def ensure_nfacct(self) -> str | None:
        """Create kube-proxy's nfacct counters here; None when they exist, else why not."""
        return await self._worker.run(nfacct.ensure)

    async def sysctl(self, path: str, value: str | None = None) -> str | None:
        """Read /proc/sys/`path` here (write `value` first when given); None when unreadable."""
        return await self._worker.run(_sysctl, path, value)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await self._worker.run(fn, *args)

    def close(self) -> None:
        self._worker.close()


def run_command(argv: list[str], stdin: str | None) -> str:
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise OffloadError(f"{argv[0]}: {err}") from None
    if proc.returncode != 0:
        text = " ".join((proc.stderr or proc.stdout).split())
        raise OffloadError(f"{argv[0]} exited {proc.returncode}: {text[:500]}")
    return proc.stdout


def _sysctl(path: str, value: str | None) -> str | None:
    full = "/proc/sys/" + path.replace(".", "/")
    try:
        if value is not None:
            with open(full, "w") as f:
                f.write(value + "\n")
        with open(full) as f:
            return f.read().strip()
    except OSError:
        return None
