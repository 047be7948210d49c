"""Prefetch: the manifests read at start, and a forked child that parses their later part.

A static agent's first sync waits for its manifests: at 10,000 Services (9.6 MB) their parse is
~1.15 s of CPU, more than half of a cold start, while the agent's own start (imports, the
datapaths) has nothing to wait for. So `usproxy run` reads the files as soon as its flags are
parsed and forks: the child parses the pieces (manifest_pieces.py) that start in the last
CHILD_SHARE of the bytes and sends their entries back pickled, while the parent imports, builds
the agent and then parses the first part itself (ManifestParser.parse with the file's
`helper`), taking the child's pieces at the end. Unpickling 12,000 of the model's objects costs
the parent ~0.1 s; building them costs ~0.45 s. Below MIN_BYTES nothing is forked (the
fork and the pickles would cost more than they save) and the source reads its files as always.

Invariants:
- Same results and errors as a parse in one process: the child's pieces are keyed by a digest of
  their text, taken from the very text the parent parses (read once, before the fork), and any
  piece the child does not deliver (its cut did not hold, an error, the child died or was killed)
  is parsed by the parent. A file that cannot be read here is left to the source, which reads it
  again and reports the error as ever.
- The child is forked before the agent has a thread, an event loop or a signal handler of its
  own; it only parses, writes to its pipe and `_exit()`s, with the default action for the signals
  that stop the agent and SIGKILL when the agent ends (PR_SET_PDEATHSIG), so it never outlives
  the agent. The parent reads the pipe to its end, or kills the child, and reaps it (its CPU
  counts in the agent's `cutime`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from usproxy.model.manifest import Packed, PieceKey, decode, manifest_files, parse_share
from usproxy.util.errors import ConfigError

log = logging.getLogger(__name__)

CHILD_SHARE = 0.45  # of the bytes: the child pickles what it parses and the parent unpickles it; measured:
# at 10,000 Services the parent waited 0.22 s for the child with 0.55, and with 0.45 the source was
# ready 0.09 s sooner (0.40 and 0.50 came out between the two)
MIN_BYTES = 1 << 20  # a smaller start is not worth a process (1 MiB: ~1,000 Services)

FileKey = tuple[int, int, int]  # (inode, size, mtime ns), as the static source keys files
Shares = dict[str, list[tuple[PieceKey, Packed]] | None]  # per file: its delivered pieces (None: none)


@dataclass
class FileShare:
    """One file's part of a Prefetch: a PieceHelper for ManifestParser.parse (its pieces from
    `start` on come from the child)."""

    prefetch: Prefetch
    path: Path
    start: int

    def result(self) -> Mapping[PieceKey, Packed] | None:
        pieces = self.prefetch.shares().get(str(self.path))
        return dict(pieces) if pieces is not None else None


@dataclass
class Prefetch:
    """Each manifest file's stat key and text, read at start, and the child parsing the later
    part of them (`pid`, `pipe`); `take()` hands a file to the source once."""

    texts: dict[Path, tuple[FileKey, str, bytes | None]]
    starts: dict[Path, int]
    pid: int = 0
    pipe: int = -1
    _shares: Shares | None = field(default=None, repr=False)

    @classmethod
    def start(cls, path: Path, share: float = CHILD_SHARE, least: int = MIN_BYTES) -> Prefetch | None:
        """Read the manifests at `path` and fork the child; None (nothing read) when they are
        smaller than `least` bytes or cannot be read here."""
        try:
            files = manifest_files(path) if path.exists() else []
            texts = {}
            for f in files:
                st = f.stat()
                data = f.read_bytes()
                plain = data.isascii() and b"\r" not in data
                texts[f] = ((st.st_ino, st.st_size, st.st_mtime_ns), decode(data, str(f)), data if plain else None)
        except (OSError, ConfigError):  # the source reads them again and reports it
            return None
        total = sum(len(text) for _, text, _ in texts.values())
        if not texts or total < least:
            return None
        cut_at = int(total * (1 - share))
        starts, offset = {}, 0
        for f, (_, text, _) in texts.items():
            starts[f] = max(0, cut_at - offset) if cut_at - offset < len(text) else len(text) + 1
            offset += len(text)
        out = cls(texts, starts)
        out._fork()
        return out

    def _fork(self) -> None:
        read, write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child (its result is what the tests check)
            os.close(read)
            _child(write, self.texts, self.starts, parent)
        os.close(write)
        self.pid, self.pipe = pid, read

    def take(self, f: Path) -> tuple[FileKey, str, bytes | None, FileShare | None] | None:
        """`f`'s stat key, text and bytes (None unless ASCII with LF line ends) as read at start,
        with its share of the child's work (None: the parent parses all of it); None when `f`
        was not read here."""
        entry = self.texts.pop(f, None)
        if entry is None:
            return None
        key, text, data = entry
        start = self.starts[f]
        return key, text, data, FileShare(self, f, start) if start <= len(text) else None

    def shares(self) -> Shares:
        """The child's pieces per file, read once (waiting for the child); {} when it failed."""
        if self._shares is None:
            self._shares = {}
            try:
                with open(self.pipe, "rb") as pipe:
                    self.pipe = -1
                    data = pipe.read()
                if data:
                    self._shares = pickle.loads(data)
            except Exception as err:  # parsed by the parent instead
                log.warning("manifest parse helper: %s; parsing its part here", err)
            self._reap(kill=False)
        return self._shares

    def close(self) -> None:
        """Forget the texts; stop the child if it still runs, and reap it."""
        self.texts.clear()
        if self.pipe >= 0:
            os.close(self.pipe)
            self.pipe = -1
        self._reap(kill=True)

    def _reap(self, kill: bool) -> None:
        if not self.pid:
            return
        pid, self.pid = self.pid, 0
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status, usage = os.wait4(pid, 0)
        log.debug("manifest parse helper: %.3f s of CPU (user %.3f)", usage.ru_utime + usage.ru_stime, usage.ru_utime)
        if not kill and os.waitstatus_to_exitcode(status) != 0:
            log.warning("manifest parse helper exited with %d; its part was parsed here",
                        os.waitstatus_to_exitcode(status))


def _child(write: int, texts: Mapping[Path, tuple[FileKey, str, bytes | None]], starts: Mapping[Path, int],
           parent: int) -> None:
    """The forked child: parse each file's share, pickle it to `write`, exit. Never returns."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(parent)
        gc.disable()  # it lives for one parse: nothing for the collector to free
        out: Shares = {str(f): parse_share(text, starts[f], str(f))
                       for f, (_, text, _) in texts.items() if starts[f] <= len(text)}
        with open(write, "wb") as pipe:
            pipe.write(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        code = 0
    except BaseException:  # the parent parses what it did not get
        pass
    finally:
        os._exit(code)


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the agent that forked it (`parent`) ends (prctl(2)
    PR_SET_PDEATHSIG): an agent killed during its start leaves no child parsing on."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the request took effect (adopted by init or a subreaper)
        os._exit(1)
