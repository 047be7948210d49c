"""Static source: Kubernetes manifests from a file or a directory, reloaded on change and SIGHUP.

Files are polled (stat: inode, size, mtime) every `poll_interval` seconds, so an edit in place and
an atomic rename are both seen within a second. Each file keeps its last good parse: a broken edit
leaves that file's objects as they were and logs why; a bad object inside a good file is skipped
with an error and counted. The first load is strict: a file that cannot be parsed at all raises
ConfigError (the CLI exits 2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from usproxy.endpoint_slice import EndpointSlice
from usproxy.errors import ConfigError
from usproxy.manifest import Manifests, load_file, manifest_files
from usproxy.ratelimit import RateLimitedLog
from usproxy.service import Service
from usproxy.sources import Provider
from usproxy.types import NamespacedName

log = logging.getLogger(__name__)

FileKey = tuple[int, int, int]
limited = RateLimitedLog(log)


@dataclass(frozen=True, slots=True)
class Scan:
    keys: dict[Path, FileKey | None]
    changed: list[Path]
    gone: list[Path]


def _stat_key(path: Path) -> FileKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class StaticSource:
    """Feeds a Provider from manifests on disk."""

    def __init__(
        self,
        path: Path,
        provider: Provider,
        *,
        poll_interval: float = 0.2,
        on_error: Callable[[ConfigError], None] | None = None,
    ) -> None:
        self.path = path
        self.provider = provider
        self.poll_interval = poll_interval
        self.on_error = on_error
        self._keys: dict[Path, FileKey | None] = {}
        self._good: dict[Path, Manifests] = {}
        self.services: dict[NamespacedName, Service] = {}
        self.slices: dict[NamespacedName, EndpointSlice] = {}
        self._reload = asyncio.Event()

    def load_initial(self) -> None:
        """First load; raises ConfigError when a file cannot be read or parsed at all."""
        if not self.path.exists():
            raise ConfigError("no such file or directory", obj=str(self.path))
        for f in manifest_files(self.path):
            self._keys[f] = _stat_key(f)
            self._good[f] = self._report(load_file(f))
        self._deliver()
        self.provider.on_services_synced()
        self.provider.on_endpoint_slices_synced()

    def request_reload(self) -> None:
        """Reload now (SIGHUP)."""
        self._reload.set()

    async def run(self) -> None:
        """Poll for changes until cancelled. Scanning and parsing run in a worker thread, so a
        large manifest does not stall the relay; no error ends the loop."""
        while True:
            try:
                await asyncio.wait_for(self._reload.wait(), self.poll_interval)
            except TimeoutError:
                pass
            forced = self._reload.is_set()
            self._reload.clear()
            try:
                scan = await asyncio.to_thread(self._scan, forced)
                if scan is not None:
                    parsed = await asyncio.to_thread(self._parse, scan.changed)
                    self._apply(scan, parsed)
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. EMFILE while listing: keep the state, try again next poll
                limited.warning("reading %s failed; keeping the last good state", self.path)

    def poll(self) -> bool:
        """Reload files that changed; returns True if any did."""
        scan = self._scan(False)
        if scan is None:
            return False
        self._apply(scan, self._parse(scan.changed))
        return True

    def _scan(self, force: bool) -> Scan | None:
        """Which files changed or went away since the last poll; None when nothing did."""
        files = manifest_files(self.path) if self.path.exists() else []
        keys = {f: _stat_key(f) for f in files}
        changed = [f for f in files if force or keys[f] != self._keys.get(f)]
        gone = [f for f in self._keys if f not in keys]
        return Scan(keys, changed, gone) if changed or gone else None

    @staticmethod
    def _parse(files: list[Path]) -> dict[Path, Manifests | ConfigError]:
        out: dict[Path, Manifests | ConfigError] = {}
        for f in files:
            try:
                out[f] = load_file(f)
            except ConfigError as err:
                out[f] = err
        return out

    def _apply(self, scan: Scan, parsed: dict[Path, Manifests | ConfigError]) -> None:
        for f in scan.gone:
            self._good.pop(f, None)
        for f, result in parsed.items():
            if isinstance(result, ConfigError):
                log.error("%s; keeping its last good state", result)
                if self.on_error is not None:
                    self.on_error(result)
            else:
                self._good[f] = self._report(result)
                log.info("reloaded %s", f)
        self._keys = scan.keys
        self._deliver()

    def _report(self, m: Manifests) -> Manifests:
        for err in m.errors:
            log.error("%s; skipped", err)
            if self.on_error is not None:
                self.on_error(err)
        for why in m.skipped:
            log.info("%s; not proxied", why)
        return m

    def _deliver(self) -> None:
        merged = Manifests()
        for f in sorted(self._good):
            m = self._good[f]
            for name in (m.services.keys() & merged.services.keys()) | (m.slices.keys() & merged.slices.keys()):
                limited.warning("%s is defined in more than one file; %s wins", name, f)
            merged.merge(m)
        for name in self.services.keys() - merged.services.keys():
            self.provider.on_service_update(self.services.pop(name), None)
        for name, svc in merged.services.items():
            if self.services.get(name) != svc:
                self.provider.on_service_update(self.services.get(name), svc)
                self.services[name] = svc
        for name in self.slices.keys() - merged.slices.keys():
            self.provider.on_endpoint_slice_update(self.slices.pop(name), None)
        for name, es in merged.slices.items():
            if self.slices.get(name) != es:
                self.provider.on_endpoint_slice_update(self.slices.get(name), es)
                self.slices[name] = es


def watch_sighup(source: StaticSource) -> None:
    """Reload `source` on SIGHUP (main thread's loop only)."""
    import signal

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, source.request_reload)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
        log.warning("SIGHUP reload unavailable in this thread")
