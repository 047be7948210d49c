"""Headless Chromium for the web view tests, driven over the DevTools protocol on a pipe.

`Browser(ns)` starts Debian's `chromium` inside network namespace `ns` (so the page reaches the
agent's 127.0.0.1 there) with --remote-debugging-pipe: commands are JSON objects ended by a NUL
byte on the child's fd 3, answers and events come back the same way on its fd 4. No network port,
no Python dependency beyond the standard library. `close()` kills the browser's process group and
removes its profile directory. Root needs --no-sandbox.

The pipe's ends are moved to fds 10 and up before the shell maps them onto 3 and 4: in a fresh
process the first pipe *is* fds 3 and 4, and `3<&3 ... 3<&-` would close the very pipe it maps.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium")


def _above_9(fd: int) -> int:
    """`fd` moved to the lowest free descriptor from 10 up (the original is closed)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)  # inherited by the browser only (pass_fds)
    os.close(fd)
    return moved


class Browser:
    def __init__(self, ns: str, width: int = 1400, height: int = 1000) -> None:
        assert CHROMIUM is not None, "chromium is not installed (scripts/setup.sh installs it)"
        self.profile = tempfile.mkdtemp(prefix="usproxy-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        cmd_r, out_w = _above_9(cmd_r), _above_9(out_w)  # never 3 or 4 themselves (docstring)
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]
        shell = f'exec ip netns exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-'
        self.proc = subprocess.Popen(["bash", "-c", shell, ns, *argv], pass_fds=(cmd_r, out_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # its own group: close() ends all of it
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False, session=True)

    def call(self, method: str, session: bool = False, timeout: float = 15.0, **params: Any) -> Any:
        """Send one command and return its result (raises RuntimeError on a protocol error)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium exited")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return dict(json.loads(raw))

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url, session=True)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able values only)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, session=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 5.0, what: str = "") -> float:
        """Wait until `expression` is truthy in the page; returns the seconds it took."""
        start = time.monotonic()
        while not self.eval(expression):
            if time.monotonic() - start > timeout:
                raise AssertionError(f"not seen within {timeout} s: {what or expression}")
            time.sleep(0.05)
        return time.monotonic() - start

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (not just the window) at `path`."""
        h = self.eval("document.documentElement.scrollHeight")
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": 1400, "height": h, "scale": 1}, session=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Kill the browser's process group (its renderer and GPU processes too), then remove
        the profile they wrote to."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the last of the group is gone
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        for fd in (self._cmd_w, self._out_r):
            os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)
