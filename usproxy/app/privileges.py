"""Privileges: whether this process may do what `usproxy run` and `usproxy check` must do.

The agent changes the network namespace (the ClusterIP interface and its addresses, listeners on
any address, nftables tables, routes): the kernel asks for CAP_NET_ADMIN for each of those. A
process without it (not root, or a container without NET_ADMIN among its effective capabilities)
would fail at its first sync and again at every retry; so the agent checks its effective
capabilities (CapEff in /proc/self/status) once at start and exits 1 with one line that says what
is missing and how to give it. `usproxy check` says "not permitted" instead of naming a missing
driver, and exits 1, for the same reason.
"""

from __future__ import annotations

from pathlib import Path

from usproxy.util.errors import CannotRun

CAP_NET_ADMIN = 12  # linux/capability.h
STATUS = Path("/proc/self/status")


def effective_capabilities(status: Path = STATUS) -> int | None:
    """The effective capability set (a bit mask), None when the kernel does not say."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def has_net_admin(status: Path = STATUS) -> bool:
    """Whether this process holds CAP_NET_ADMIN (True when unknown: the kernel will say)."""
    caps = effective_capabilities(status)
    return caps is None or bool(caps >> CAP_NET_ADMIN & 1)


def require_net_admin(command: str, status: Path = STATUS) -> None:
    """Raise CannotRun (exit 1) when this process lacks CAP_NET_ADMIN."""
    if not has_net_admin(status):
        raise CannotRun(f"{command}: not permitted: this process lacks CAP_NET_ADMIN, which the "
                        "ClusterIP interface, the listeners and the kernel tables need; run it as root, "
                        "or add NET_ADMIN to the container's securityContext.capabilities")
