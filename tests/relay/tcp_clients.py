"""Client side of the TCP field-case tests: attempts classified, idsrv questions, threads in netns.

`attempt()` classifies one connect the way C01 and C21 need it (ok, refused, timeout, reset, empty
reply). `NsPool` is a thread pool whose threads live in one client netns, so many clients can run
at once from the test process; `run_async()` runs a coroutine on a fresh asyncio loop in a thread
inside a netns (for hundreds of concurrent connections). `start_server()` starts a tcp_servers.py
program in a pod netns under the Backends fixture, so it is stopped whatever happens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.netns import inside, nsexec
from usproxy.util.netns import setns
from tests.relay.harness import Backends

T = TypeVar("T")
TCP_SERVERS = str(Path(__file__).with_name("tcp_servers.py"))


@dataclass(frozen=True)
class Outcome:
    """One connection attempt: kind is ok, refused, timeout, reset, empty or error:<errno name>."""

    kind: str
    elapsed: float
    name: str = ""


def attempt(addr: str, port: int, timeout: float = 3.0) -> Outcome:
    """Connect and read idsrv's name line (call inside a netns)."""
    t0 = time.monotonic()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        line = s.makefile("rb").readline()
        if not line:
            return Outcome("empty", time.monotonic() - t0)
        return Outcome("ok", time.monotonic() - t0, line.decode().strip())
    except ConnectionRefusedError:
        return Outcome("refused", time.monotonic() - t0)
    except ConnectionResetError:
        return Outcome("reset", time.monotonic() - t0)
    except (socket.timeout, TimeoutError):
        return Outcome("timeout", time.monotonic() - t0)
    except OSError as err:
        return Outcome(f"error:{errno.errorcode.get(err.errno or 0, str(err))}", time.monotonic() - t0)
    finally:
        s.close()


def ask(addr: str, port: int, timeout: float = 3.0) -> str:
    """The idsrv name behind addr:port; raises unless the connection works (call inside a netns)."""
    with socket.create_connection((addr, port), timeout=timeout) as s:
        line = s.makefile("rb").readline()
    if not line:
        raise ConnectionError(f"{addr}:{port}: empty reply")
    return line.decode().strip()


def ask_in(ns: str, addr: str, port: int, source: str | None = None) -> str:
    with inside(ns):
        if source is None:
            return ask(addr, port)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(3.0)
        s.bind((source, 0))
        s.connect((addr, port))
        line = s.makefile("rb").readline()
    finally:
        s.close()
    if not line:
        raise ConnectionError(f"{addr}:{port} from {source}: empty reply")
    return line.decode().strip()


class NsPool(concurrent.futures.ThreadPoolExecutor):
    """Worker threads that stay in netns `ns` for their whole life."""

    def __init__(self, ns: str, workers: int) -> None:
        self._fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        super().__init__(max_workers=workers, initializer=setns, initargs=(self._fd,))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait, cancel_futures=cancel_futures)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def run_async(ns: str, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `factory()` on a new asyncio loop in a thread inside netns `ns`; returns its result."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            with inside(ns):
                box["result"] = asyncio.run(factory())
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    t = threading.Thread(target=main)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


def start_server(backends: Backends, ns: str, *args: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, TCP_SERVERS, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    if p.stdout.readline().strip() != b"ready":
        p.kill()
        p.wait()
        raise RuntimeError(f"tcp_servers.py {' '.join(args)} did not start")
    backends.procs.append(p)
    return p


def idsrv_log_after(path: Path, t: float) -> list[str]:
    """Peers of idsrv --log lines at or after monotonic time t."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        stamp, _, peer, *_ = line.split()
        if float(stamp) >= t:
            out.append(peer)
    return out


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def agent_sockets(node_ns: str, pid: int) -> list[tuple[str, str, str]]:
    """(state, local, peer) of the agent's TCP sockets, from `ss -tanp` in the node netns."""
    out = nsexec(node_ns, "ss", "-tanpH").stdout
    rows = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 6 and f"pid={pid}," in line:
            rows.append((cols[0], cols[3], cols[4]))
    return rows


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def median(xs: Iterable[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")
