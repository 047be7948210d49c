"""NftClient: libnftables transport, one kernel transaction per call.

Every call runs in one dedicated worker thread (NetnsWorker: libnftables blocks, the agent's loop
must not), which first enters `netns` when one is given (tests program a throwaway namespace from
the test process). Transactions are written in nft's own syntax and handed to libnftables'
`nft_run_cmd_from_buffer` (the `cmd()` of the pip-nftables / python3-nftables binding): one call is
one netlink batch, so a failing command rolls back the whole transaction. Reads ask for JSON
output (`list table` as `nft -j`), which is what read back parses.

Why nft syntax rather than JSON input: libnftables 1.0.6 (Debian 12) cannot express this layout in
JSON: it rejects map data of concatenated types ("Invalid map type 'ipv4_addr . inet_service'")
and crashes on a `dnat to <concatenation> map` rule. Output JSON is fine.

The libnftables context, and with it its netlink socket, is created by the constructor, in the
worker thread (so in `netns`), and kept for the client's life. libnftables waits on that socket
with select(), which aborts the process ("bit out of range 0 - FD_SETSIZE") when its number is
1024 or more; the agent builds its datapaths before it opens any listener or accepts any flow,
so the socket gets a low number however many descriptors the agent holds later.

When the binding cannot be loaded, `nft -f -` / `nft -j list` through a subprocess is the fallback
(what kube-proxy's knftables does), entered into `netns` with `ip netns exec`.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from usproxy.util.errors import OffloadError
from usproxy.offload.netns_worker import NetnsWorker
from usproxy.offload.nftables.commands import Command, render

log = logging.getLogger(__name__)

# The layout's features in one throwaway table (nat hook, concatenated map data, numgen vmap),
# added and deleted in one transaction, so nothing stays: the agent and `usproxy check` both run it.
PROBE = ("add table ip usproxy-probe\n"
         "add map ip usproxy-probe m { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }\n"
         "add chain ip usproxy-probe d\n"
         "add rule ip usproxy-probe d dnat ip to ip daddr . meta l4proto . th dport map @m\n"
         "add chain ip usproxy-probe c { type nat hook prerouting priority dstnat; policy accept; }\n"
         "add rule ip usproxy-probe c numgen random mod 2 vmap { 0 : goto d, 1 : goto d }\n"
         "delete table ip usproxy-probe\n")

_ERRNO = {"No such file or directory": 2, "File exists": 17, "Device or resource busy": 16,
          "Operation not permitted": 1, "Invalid argument": 22, "Operation not supported": 95,
          "No buffer space available": 105, "Message too long": 90, "Protocol not supported": 93}


def errno_of(message: str) -> int:
    """The errno behind an nft error message ("Error: Could not process rule: File exists")."""
    for text, num in _ERRNO.items():
        if text in message:
            return num
    return 0


class NftClient:
    """Runs nft transactions and listings, in `netns` when given."""

    def __init__(self, netns: str | None = None, *, use_library: bool = True) -> None:
        self.netns = netns
        self._worker = NetnsWorker("nft", netns)
        self._nft: Any = None
        self._use_library = use_library
        self.backend = "unknown"
        if use_library:
            self._worker.call(self._ctx)  # now, while descriptor numbers are low (module docstring)

    def _ctx(self) -> Any:
        if self._nft is None and self._use_library:
            try:
                import nftables

                self._nft = nftables.Nftables()
                self.backend = "libnftables"
            except (ImportError, OSError) as err:
                log.warning("libnftables binding unavailable (%s); using the nft command", err)
                self._use_library = False
        if self._nft is None:
            self.backend = "nft command"
        return self._nft

    # -- blocking parts (worker thread)
    def _run_text(self, text: str, json_out: bool) -> str:
        nft = self._ctx()
        if nft is None:
            return self._run_cli(text, json_out)
        nft.set_json_output(json_out)
        rc, out, err = nft.cmd(text)
        if rc != 0:
            raise OffloadError(f"nft: {self._located(text, err)}", errno_of(err))
        return str(out)

    def _located(self, text: str, err: str) -> str:
        """The first error with the command it is about. libnftables 1.0.6 prints the first line of
        a buffer as the context of a kernel error however deep in the batch the failing element
        is (the column marks are right); `nft -c -f FILE` (check only, nothing committed) names
        the line, so on such errors the batch is checked once more from a file to find it."""
        first = _first_error(err)
        lines = text.splitlines()
        if len(lines) < 2 or lines[0] not in err:
            return first
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
            f.write(text)
            f.flush()
            try:  # the worker thread is in `netns`, and so is its child
                res = subprocess.run(["nft", "-c", "-f", f.name], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                return first
        m = re.search(r":(\d+):(\d+)-(\d+): (Error: [^\n]*)", res.stderr)
        if m is None or not 0 < int(m.group(1)) <= len(lines):
            return first
        line, lo, hi = lines[int(m.group(1)) - 1], int(m.group(2)), int(m.group(3))
        head = " ".join(line.split()[:5])  # e.g. "add element ip usproxy slot-0"
        return f"{m.group(4).strip()} [{head} ... {line[lo - 1:hi]}]"

    def _run_cli(self, text: str, json_out: bool) -> str:
        # a child forked from the worker thread starts in the thread's network namespace
        argv = ["nft", *(["-j"] if json_out else []), "-f", "-"]
        try:
            res = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise OffloadError(f"nft: {err}") from None
        if res.returncode != 0:
            raise OffloadError(f"nft: {_first_error(res.stderr)}", errno_of(res.stderr))
        return res.stdout

    # -- async API
    async def apply(self, commands: Sequence[Command]) -> None:
        """Apply Commands as one transaction. Raises OffloadError; then nothing changed."""
        await self.run(render(commands))

    async def run(self, text: str) -> None:
        """Apply one transaction (nft syntax). Raises OffloadError; then nothing changed."""
        await self._worker.run(self._run_text, text, False)

    async def list_set(self, family: str, table: str, name: str) -> str:
        """`nft list set` as text (its JSON rounds element timers to whole seconds); "" when the
        set does not exist."""
        return await self._worker.run(self._list_set, family, table, name)

    def _list_set(self, family: str, table: str, name: str) -> str:
        try:
            return self._run_text(f"list set {family} {table} {name}", False)
        except OffloadError as err:
            if err.errno == 2:
                return ""
            raise

    async def list_table(self, family: str, table: str) -> list[dict[str, Any]] | None:
        """`nft -j list table`: the objects of the listing, or None when there is no such table."""
        return await self._worker.run(self._list_table, family, table)

    def _list_table(self, family: str, table: str) -> list[dict[str, Any]] | None:
        try:
            out = self._run_text(f"list table {family} {table}", True)
        except OffloadError as err:
            if err.errno == 2:
                return None
            raise
        items = json.loads(out).get("nftables", [])
        return [x for x in items if "metainfo" not in x]

    def probe(self) -> str:
        """Load and delete, in one transaction, a table with this layout's features (PROBE):
        raises OffloadError when the kernel lacks one. Returns the backend (libnftables or the
        nft command)."""
        self._worker.call(self._run_text, PROBE, False)
        return self.backend

    def close(self) -> None:
        self._worker.close()


def _first_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if re.search(r"Error:", ln):
            ctx = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{ln.strip()} [{ctx[:160]}]" if ctx else ln.strip()
    return " ".join(lines)[:300] or "failed"
