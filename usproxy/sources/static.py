"""Static source: Kubernetes manifests from a file or a directory, reloaded on change and SIGHUP.

Files are polled (stat: inode, size, mtime) every `poll_interval` seconds, and looked at as soon
as inotify reports a change in their directory (file_watch.py), so an atomic rename is read at
once and an edit in place once it settles. Each file keeps its last good parse: a broken edit
leaves that file's objects as they were and logs why; a bad object inside a good file is skipped
with an error and counted. The first load is strict: a file that cannot be parsed at all raises
ConfigError (the CLI exits 2).

Invariants, so that no local fault and no half-written file withdraws a Service:
- A read error (a directory that cannot be listed, a file that cannot be read: EMFILE, EACCES, EIO)
  never reads as "no objects": the affected files keep their last good state, the error is logged
  with its errno and counted (`on_error`), and the read is tried again at the next poll.
- A file rewritten in place (the same inode; `kubectl get ... -o yaml > file`: truncated, then
  written) or a new file is read only once its stat key has stayed the same for `settle` seconds,
  and the read is discarded if the key changed while it was read; a file that held objects and now
  holds none (truncated, not yet written) is believed only once it has stayed so for `empty_settle`
  seconds. A file replaced by a rename (a new inode) is complete by construction and read at once;
  a file that changes more often than `settle` is read anyway MAX_WAIT seconds after its first
  change not yet taken (the emptied-file rule still holds).
  A removed file withdraws its objects at once (removal is never a step of a rewrite).
- ServiceCIDR objects (networking.k8s.io/v1) are read as the Kubernetes source reads them: the
  union of their CIDRs goes to the Provider (if it takes them) whenever it changes.
- detectLocalMode NodeCIDR reads this node's Node object (spec.podCIDRs) from the manifests once,
  before the agent is built (`static_pod_cidrs`); a reload that changes them is logged (restart
  to apply), and the detector keeps the pod CIDRs it was built from.
- Files are parsed in a worker thread; a change is delivered on the loop a TimeSlice at a time
  with the Provider's syncs held, so a large manifest neither stalls the relay nor is synced
  half-delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from usproxy.model.endpoint_slice import EndpointSlice
from usproxy.util.errors import ConfigError
from usproxy.util.gc_pause import gc_paused, promote_survivors
from usproxy.model.manifest import ManifestParser, ManifestReadError, Manifests, load_file, manifest_files
from usproxy.model.node import NodeFacts
from usproxy.util.ratelimit import RateLimitedLog
from usproxy.model.service import Service
from usproxy.core.datapath import ServiceCIDRHandler
from usproxy.model.service_cidr import ServiceCIDRTracker
from usproxy.sources import Provider, hold_syncs
from usproxy.sources.file_watch import FileWatch
from usproxy.sources.parse_helper import Prefetch
from usproxy.util.time_slice import TimeSlice
from usproxy.model.types import IPNetwork, NamespacedName

log = logging.getLogger(__name__)

FileKey = tuple[int, int, int]  # (inode, size, mtime ns)
limited = RateLimitedLog(log)
SETTLE = 0.2  # seconds a changed file's stat key must stay the same before it is read
EMPTY_SETTLE = 5.0  # seconds a file that held objects must stay empty before it is believed
MAX_WAIT = 0.5  # seconds a file that keeps changing waits at most before it is read anyway


@dataclass(frozen=True, slots=True)
class Scan:
    """One poll: the settled files to read (with the key each had), the files that went away."""

    ready: dict[Path, FileKey | None]
    gone: list[Path]


@dataclass(frozen=True, slots=True)
class Read:
    """One file read: its parse or the error, and whether its stat key held still during the read."""

    result: Manifests | ConfigError
    key: FileKey | None
    stable: bool


def _stat_key(path: Path) -> FileKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _written_during_read(before: FileKey | None, after: FileKey | None) -> bool:
    """Whether the same inode changed while it was read. A rename meanwhile does not count: the
    inode that was read is complete, and the new one is read at the next poll."""
    return before is not None and after is not None and before[0] == after[0] and before != after


def _is_empty(m: Manifests) -> bool:
    return not (m.services or m.slices or m.service_cidrs or m.nodes or m.errors or m.skipped)


class StaticSource:
    """Feeds a Provider from manifests on disk. `settle` and `empty_settle` are in seconds,
    `clock` gives monotonic seconds (tests pass their own). `node`: this node, whose Node object's
    spec.podCIDRs are compared at each reload with those its NodeCIDR detector was built from."""

    def __init__(
        self,
        path: Path,
        provider: Provider,
        *,
        poll_interval: float = 0.2,
        on_error: Callable[[ConfigError], None] | None = None,
        settle: float = SETTLE,
        empty_settle: float = EMPTY_SETTLE,
        clock: Callable[[], float] = time.monotonic,
        node: NodeFacts = NodeFacts(),
    ) -> None:
        self.path = path
        self.node = node
        self._pod_cidrs_seen = node.pod_cidrs  # the last pod CIDRs warned about
        self.provider = provider
        self.poll_interval = poll_interval
        self.on_error = on_error
        self.settle = settle
        self.empty_settle = empty_settle
        self.clock = clock
        self._keys: dict[Path, FileKey | None] = {}  # the key of each file's last accepted read
        self._seen: dict[Path, tuple[FileKey | None, float]] = {}  # a new key, and since when
        self._pending: dict[Path, float] = {}  # since when a change of the file waits to be taken
        self._good: dict[Path, Manifests] = {}
        self._parsers: dict[Path, ManifestParser] = {}  # each file's pieces, to parse only what changed
        self.services: dict[NamespacedName, Service] = {}
        self.slices: dict[NamespacedName, EndpointSlice] = {}
        self.service_cidrs = ServiceCIDRTracker(self._service_cidrs_changed)
        self._wake = asyncio.Event()  # SIGHUP, or inotify: look now
        self._forced = False  # SIGHUP: read every file, changed or not

    def load_initial(self, prefetch: Prefetch | None = None) -> None:
        """First load; raises ConfigError when a file cannot be read or parsed at all. A file
        `prefetch` read at start is parsed from that text, with the child's share of it."""
        if not self.path.exists():
            raise ConfigError("no such file or directory", obj=str(self.path))
        for f in manifest_files(self.path):
            early = prefetch.take(f) if prefetch is not None else None
            if early is None:
                self._keys[f] = _stat_key(f)
                self._good[f] = self._report(load_file(f, self._parser(f)))
                continue
            self._keys[f], text, data, share = early
            self._good[f] = self._report(self._parser(f).parse(text, str(f), share, data))
        if prefetch is not None:
            prefetch.close()
        self._deliver()
        self.provider.on_services_synced()
        self.provider.on_endpoint_slices_synced()

    def request_reload(self) -> None:
        """Reload now (SIGHUP)."""
        self._forced = True
        self._wake.set()

    async def run(self) -> None:
        """Poll for changes until cancelled, and look at once when inotify says the path changed
        (file_watch.py). Scanning and parsing run in a worker thread, so a large manifest does
        not stall the relay; no error ends the loop."""
        loop = asyncio.get_running_loop()
        watch = FileWatch.of(self.path) if self.path.exists() else None
        if watch is not None:
            loop.add_reader(watch.fd, watch.reader(self._wake.set))
        try:
            await self._poll_forever()
        finally:
            if watch is not None:
                loop.remove_reader(watch.fd)
                watch.close()

    async def _poll_forever(self) -> None:
        while True:
            try:
                # not asyncio.wait_for: on 3.11, when the wait ends (an inotify event) as the task
                # is cancelled, it returns instead of raising, and the agent's exit waited forever
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            forced, self._forced = self._forced, False
            self._wake.clear()
            try:
                scan = await asyncio.to_thread(self._scan, forced)
                if scan is not None:
                    await self._reload_in_turns(scan)
            except asyncio.CancelledError:
                raise
            except ManifestReadError as err:
                self._read_failed(err)
            except Exception:  # a bug or a fault not foreseen: keep the state, try again next poll
                limited.warning("reading %s failed; keeping the last good state", self.path)

    def poll(self) -> bool:
        """Reload files that changed and settled; returns True if any did or went away (False,
        state kept and the error counted, when the directory cannot be listed)."""
        try:
            scan = self._scan(False)
        except ManifestReadError as err:
            self._read_failed(err)
            return False
        if scan is None:
            return False
        return self._apply(scan, self._read(scan.ready))

    def _scan(self, force: bool) -> Scan | None:
        """The files whose change has settled (every file when forced) and the files that went
        away; None when there are neither. Raises ManifestReadError when a directory cannot be
        listed: a partial listing would read as removals."""
        files = manifest_files(self.path) if self.path.exists() else []
        now = self.clock()
        ready: dict[Path, FileKey | None] = {}
        for f in files:
            key = _stat_key(f)
            if key == self._keys.get(f) and f in self._keys:
                self._seen.pop(f, None)
                if force:
                    ready[f] = key
            elif self._renamed(f, key) or self._settled(f, key, now, self.settle) or self._waited(f, now):
                ready[f] = key
        listed = set(files)
        for f in self._seen.keys() - listed:
            del self._seen[f]
        for f in self._pending.keys() - listed:
            del self._pending[f]
        gone = [f for f in self._keys if f not in listed]
        return Scan(ready, gone) if ready or gone else None

    def _renamed(self, f: Path, key: FileKey | None) -> bool:
        """Whether `f` was replaced by another file (a new inode: an atomic rename, complete by
        construction) rather than written in place (the same inode: maybe a write in progress)."""
        old = self._keys.get(f)
        return old is not None and key is not None and key[0] != old[0]

    def _waited(self, f: Path, now: float) -> bool:
        """Whether a change of `f` has waited MAX_WAIT seconds (a file that changes more often
        than `settle`, e.g. rewritten every 0.1 s, is still read twice a second)."""
        return now - self._pending.setdefault(f, now) >= MAX_WAIT

    def _settled(self, f: Path, key: FileKey | None, now: float, period: float) -> bool:
        """Whether `f` has had `key` for `period` seconds (the first sighting starts the clock)."""
        seen = self._seen.get(f)
        if seen is None or seen[0] != key:
            self._seen[f] = seen = (key, now)
        return now - seen[1] >= period

    def _parser(self, f: Path) -> ManifestParser:
        parser = self._parsers.get(f)
        if parser is None:
            parser = self._parsers[f] = ManifestParser()
        return parser

    def _read(self, files: dict[Path, FileKey | None]) -> dict[Path, Read]:
        """Read and parse `files` (in a worker thread: nothing else touches the parsers then)."""
        out: dict[Path, Read] = {}
        for f, key in files.items():
            try:
                result: Manifests | ConfigError = load_file(f, self._parser(f))
            except ConfigError as err:
                result = err
            out[f] = Read(result, key, not _written_during_read(key, _stat_key(f)))
        return out

    def _apply(self, scan: Scan, reads: dict[Path, Read]) -> bool:
        """Take what was read and deliver the change in one piece; returns True when some file's
        state changed or went away."""
        changed = self._take_all(scan, reads)
        if changed:
            self._deliver()
        return changed

    def _take_all(self, scan: Scan, reads: dict[Path, Read]) -> bool:
        """Take what was read, delivering nothing; returns True when some file's state changed
        or went away."""
        for f in scan.gone:
            self._good.pop(f, None)
            self._parsers.pop(f, None)
            self._keys.pop(f, None)
            self._seen.pop(f, None)
            self._pending.pop(f, None)
        changed = bool(scan.gone)
        for f, read in reads.items():
            changed |= self._take(f, read)
        return changed

    def _take(self, f: Path, read: Read) -> bool:
        """One file's read: kept as its new state, or held back (still changing, read error,
        empty and not yet settled) with its last good state kept."""
        result = read.result
        if not read.stable:  # written while it was read: read it again once it settles
            self._seen.pop(f, None)
            return False
        if isinstance(result, ManifestReadError):
            self._read_failed(result)
            return False
        if isinstance(result, ConfigError):
            log.error("%s; keeping its last good state", result)
            self._count(result)
            self._keys[f] = read.key  # read again only once it changes
            self._pending.pop(f, None)
            return False
        if _is_empty(result) and not _is_empty(self._good.get(f, result)) and not self._renamed(f, read.key):
            if not self._settled(f, read.key, self.clock(), self.empty_settle):
                limited.warning("%s is empty; keeping its objects until it stays empty for %gs", f, self.empty_settle)
                self._pending[f] = self.clock()  # the write that follows the truncation gets its own wait
                return False
            log.warning("%s stayed empty for %gs; withdrawing its objects", f, self.empty_settle)
        self._good[f] = self._report(result)
        self._keys[f] = read.key
        self._seen.pop(f, None)
        self._pending.pop(f, None)
        log.info("reloaded %s", f)
        return True

    def _read_failed(self, err: ManifestReadError) -> None:
        limited.warning("%s (errno %d); keeping the last good state", err, err.errno)
        self._count(err)

    def _count(self, err: ConfigError) -> None:
        if self.on_error is not None:
            self.on_error(err)

    def _report(self, m: Manifests) -> Manifests:
        for err in m.errors:
            log.error("%s; skipped", err)
            self._count(err)
        for why in m.skipped:
            log.info("%s; not proxied", why)
        return m

    def _deliver(self) -> None:
        for _ in self._deliveries():
            pass

    async def _reload_in_turns(self, scan: Scan) -> None:
        """Read the settled files in a worker thread and deliver what changed in turns, with the
        cyclic collector paused (its passes over a growing heap stall the loop; gc_pause)."""
        with gc_paused(True):
            if self._take_all(scan, await asyncio.to_thread(self._read, scan.ready)):
                await self._deliver_in_turns()
            promote_survivors()

    async def _deliver_in_turns(self) -> None:
        """`_deliver` with the loop given a turn every TimeSlice budget and the Provider's syncs
        held until the whole change is delivered (a directory of 100,000 endpoints)."""
        turn = TimeSlice()
        with hold_syncs(self.provider):
            for _ in self._deliveries():
                await turn.pause()

    def _deliveries(self) -> Iterator[None]:
        """Deliver the merged state of every file's last good parse, in order: removed Services,
        changed Services, removed slices, changed slices; yields after each Provider call."""
        merged = Manifests()
        for f in sorted(self._good):
            m = self._good[f]
            for name in (m.services.keys() & merged.services.keys()) | (m.slices.keys() & merged.slices.keys()):
                limited.warning("%s is defined in more than one file; %s wins", name, f)
            merged.merge(m)
        for name in self.services.keys() - merged.services.keys():
            self.provider.on_service_update(self.services.pop(name), None)
            yield
        for name, svc in merged.services.items():
            old = self.services.get(name)
            if old is not svc and old != svc:  # an unchanged piece of a file yields the same object
                self.provider.on_service_update(self.services.get(name), svc)
                self.services[name] = svc
                yield
        for name in self.slices.keys() - merged.slices.keys():
            self.provider.on_endpoint_slice_update(self.slices.pop(name), None)
            yield
        for name, es in merged.slices.items():
            prev = self.slices.get(name)
            if prev is not es and prev != es:
                self.provider.on_endpoint_slice_update(self.slices.get(name), es)
                self.slices[name] = es
                yield
        self.service_cidrs.replace(merged.service_cidrs.values())
        self._check_pod_cidrs(merged)

    def _check_pod_cidrs(self, merged: Manifests) -> None:
        """Warn once per new value when this Node's podCIDRs differ from the detector's."""
        mine = merged.nodes.get(self.node.name or "")
        if self.node.pod_cidrs is None or mine is None or mine.pod_cidrs == self._pod_cidrs_seen:
            return
        self._pod_cidrs_seen = mine.pod_cidrs
        if mine.pod_cidrs != self.node.pod_cidrs:
            log.warning("Node %s: spec.podCIDRs now %s; detectLocalMode NodeCIDR keeps %s, read at start: "
                        "restart usproxy to apply", self.node.name, _text(mine.pod_cidrs), _text(self.node.pod_cidrs))

    def _service_cidrs_changed(self, cidrs: tuple[IPNetwork, ...]) -> None:
        log.info("ServiceCIDRs: %s", ", ".join(map(str, cidrs)) or "none")
        if isinstance(self.provider, ServiceCIDRHandler):
            self.provider.on_service_cidrs_changed(cidrs)


def _text(cidrs: tuple[IPNetwork, ...]) -> str:
    return ", ".join(map(str, cidrs)) or "none"


def static_pod_cidrs(path: Path, node_name: str | None) -> tuple[IPNetwork, ...]:
    """This node's spec.podCIDRs from the manifests at `path` (file or directory), for
    detectLocalMode NodeCIDR without a cluster: the Node object named `node_name`. Raises
    ConfigError naming --detect-local-mode and what is missing (no node name, no such Node, no
    podCIDRs), the Node's own error when its podCIDRs do not parse, or the manifest's when it
    cannot be read or parsed at all."""
    why = "--detect-local-mode NodeCIDR (detectLocalMode)"
    if node_name is None:
        raise ConfigError(f"{why} needs this node's name: give --hostname-override or NODE_NAME", obj="usproxy run")
    if not path.exists():  # as load_initial
        raise ConfigError("no such file or directory", obj=str(path))
    merged = Manifests()
    for f in manifest_files(path):
        merged.merge(load_file(f))
    mine = f"Node {node_name}"
    for err in merged.errors:
        if err.obj == mine:
            raise err
    node = merged.nodes.get(node_name)
    if node is None:
        raise ConfigError(f"{why} needs a Node object named {node_name!r} with spec.podCIDRs in {path}",
                          obj="usproxy run")
    if not node.pod_cidrs:
        raise ConfigError(f"{why} needs the pod CIDRs of this node, none given", obj=mine, field="spec.podCIDRs")
    log.info("Node %s: podCIDRs %s (detectLocalMode NodeCIDR, from %s)", node_name, _text(node.pod_cidrs), path)
    return node.pod_cidrs


def watch_sighup(source: StaticSource) -> None:
    """Reload `source` on SIGHUP (main thread's loop only)."""
    import signal

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, source.request_reload)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
        log.warning("SIGHUP reload unavailable in this thread")
