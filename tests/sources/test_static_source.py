"""The static source: atomic renames and in-place edits are picked up, a directory's files merge,
a removed file withdraws its objects, SIGHUP forces a reload, and a broken edit keeps that file's
last good state while the other files keep working."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.sources.conftest import Recorder, service_yaml
from usproxy.model.types import NamespacedName
from usproxy.util.errors import ConfigError
from usproxy.sources.static import StaticSource, watch_sighup


def ports(rec: Recorder, name: str) -> list[int]:
    return [sp.port for sp in rec.services[NamespacedName("default", name)].ports.values()]


def rename_into(path: Path, text: str) -> None:
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text(text)
    os.rename(tmp, path)


def test_directory_merge_rename_edit_and_removal(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(service_yaml("a", 80))
    (tmp_path / "b.yml").write_text(service_yaml("b", 81))
    (tmp_path / "notes.txt").write_text("not a manifest")
    rec = Recorder()
    src = StaticSource(tmp_path, rec, settle=0.0)
    src.load_initial()
    assert rec.synced == ["services", "endpointslices"] and set(n.name for n in rec.services) == {"a", "b"}
    rename_into(tmp_path / "a.yaml", service_yaml("a", 90))
    assert src.poll() and ports(rec, "a") == [90]
    (tmp_path / "b.yml").write_text(service_yaml("b", 91) + "# longer\n")  # edit in place
    assert src.poll() and ports(rec, "b") == [91]
    (tmp_path / "b.yml").unlink()
    assert src.poll() and set(n.name for n in rec.services) == {"a"}
    assert not src.poll()  # nothing changed: nothing delivered


def test_broken_edit_keeps_last_good_state_of_that_file_only(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(service_yaml("a", 80))
    (tmp_path / "b.yaml").write_text(service_yaml("b", 81))
    errors: list[ConfigError] = []
    rec = Recorder()
    src = StaticSource(tmp_path, rec, on_error=errors.append, settle=0.0)
    src.load_initial()
    rename_into(tmp_path / "a.yaml", "kind: Service\n  broken: [")
    rename_into(tmp_path / "b.yaml", service_yaml("b", 82))
    src.poll()
    assert ports(rec, "a") == [80] and ports(rec, "b") == [82]
    assert "a.yaml: cannot parse" in str(errors[0])


async def test_sighup_forces_a_reload(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text(service_yaml("a", 80))
    rec = Recorder()
    src = StaticSource(tmp_path, rec, poll_interval=3600)  # polling would never notice in time
    src.load_initial()
    st = f.stat()
    f.write_text(service_yaml("a", 88))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: invisible to stat
    task = asyncio.create_task(src.run())
    watch_sighup(src)
    try:
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if ports(rec, "a") == [88]:
                break
            await asyncio.sleep(0.01)
        assert ports(rec, "a") == [88]
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("as_file", [False, True])
async def test_a_renamed_in_manifest_is_read_at_once_not_at_the_next_poll(tmp_path: Path, as_file: bool) -> None:
    """inotify wakes the source (file_watch.py): with polling an hour apart, a file replaced by a
    rename (as an editor or `mv` does), in a watched directory or given as the path itself, is
    read within moments."""
    f = tmp_path / "a.yaml"
    f.write_text(service_yaml("a", 80))
    rec = Recorder()
    src = StaticSource(f if as_file else tmp_path, rec, poll_interval=3600)
    src.load_initial()
    task = asyncio.create_task(src.run())
    try:
        await asyncio.sleep(0.05)
        rename_into(f, service_yaml("a", 81))
        for _ in range(200):
            if ports(rec, "a") == [81]:
                break
            await asyncio.sleep(0.01)
        assert ports(rec, "a") == [81]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_failing_scan_keeps_state_and_the_loop_alive(tmp_path: Path, monkeypatch: Any) -> None:
    import usproxy.model.manifest as manifest
    import usproxy.sources.static as static

    (tmp_path / "a.yaml").write_text(service_yaml("a", 80))
    rec = Recorder()
    src = StaticSource(tmp_path, rec, poll_interval=0.01)
    src.load_initial()
    real = manifest.manifest_files
    calls = [0]

    def flaky(path: Path) -> list[Path]:
        calls[0] += 1
        if calls[0] <= 3:
            raise OSError(24, "Too many open files")
        return real(path)
    monkeypatch.setattr(static, "manifest_files", flaky)
    task = asyncio.create_task(src.run())
    try:
        rename_into(tmp_path / "a.yaml", service_yaml("a", 99))
        for _ in range(200):
            if ports(rec, "a") == [99]:
                break
            await asyncio.sleep(0.01)
        assert calls[0] > 3 and ports(rec, "a") == [99] and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- Everything withdrawn on a local error (issue 18 item 4) -----------------------------------

EMFILE_SCRIPT = r"""
import json, os, resource, sys
from pathlib import Path
sys.path.insert(0, os.environ["TESTS_ROOT"])
from tests.sources.conftest import Recorder, service_yaml
from usproxy.sources.static import StaticSource

root = Path(sys.argv[1])
rec, errors = Recorder(), []
src = StaticSource(root, rec, on_error=errors.append, settle=0.0, poll_interval=0.01)
src.load_initial()
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as err:
    assert err.errno == 24, err
out = {"poll": src.poll()}
out["during"] = sorted(n.name for n in rec.services)
out["errnos"] = sorted({getattr(e, "errno", None) for e in errors})
for fd in held:
    os.close(fd)
(root / "sub" / "b.yaml").write_text(service_yaml("b", 82))
src.poll()
out["after"] = sorted(n.name for n in rec.services)
out["b"] = [sp.port for sp in rec.services[next(n for n in rec.services if n.name == "b")].ports.values()]
print(json.dumps(out))
"""


def test_everything_withdrawn_on_a_local_error_emfile_keeps_every_service(tmp_path: Path) -> None:
    """With the descriptor limit reached (a health-port flood, listeners plus flows), the
    directory cannot be listed: the source keeps every Service, counts the error with its errno,
    and reloads once descriptors are back."""
    import json
    import subprocess
    import sys

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text(service_yaml("a", 80))
    (tmp_path / "sub" / "b.yaml").write_text(service_yaml("b", 81))
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", EMFILE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "TESTS_ROOT": repo, "PYTHONPATH": repo}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["poll"] is False  # nothing delivered: no listing read as an empty directory
    assert out["during"] == ["a", "b"]
    assert 24 in out["errnos"]
    assert out["after"] == ["a", "b"] and out["b"] == [82]


def test_everything_withdrawn_on_a_local_error_unreadable_file_is_retried(tmp_path: Path, monkeypatch: Any) -> None:
    """A changed file that cannot be read (EMFILE) keeps its last good state and is read again at
    the next poll, without needing another change."""
    f = tmp_path / "a.yaml"
    f.write_text(service_yaml("a", 80))
    errors: list[Any] = []
    rec = Recorder()
    src = StaticSource(tmp_path, rec, on_error=errors.append, settle=0.0)
    src.load_initial()
    real = Path.read_bytes
    failing = [True]

    def read_bytes(self: Path) -> bytes:
        if failing[0] and self == f:
            raise OSError(24, "Too many open files", str(self))
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    rename_into(f, service_yaml("a", 90))
    assert not src.poll()
    assert ports(rec, "a") == [80] and errors and errors[-1].errno == 24
    assert "EMFILE" in str(errors[-1])
    failing[0] = False
    assert src.poll() and ports(rec, "a") == [90]


def test_everything_withdrawn_on_a_local_error_unlistable_subdirectory_raises(tmp_path: Path) -> None:
    """A directory that cannot be listed raises ManifestReadError instead of listing as empty; a
    directory that vanished while walked is still ignored."""
    import pytest

    from usproxy.model.manifest import ManifestReadError, manifest_files

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text(service_yaml("b", 81))
    real = os.scandir

    def scandir(path: Any) -> Any:
        if str(path).endswith("sub"):
            raise OSError(13, "Permission denied", str(path))
        return real(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", scandir)
        with pytest.raises(ManifestReadError, match="EACCES") as err:
            manifest_files(tmp_path)
        assert err.value.errno == 13

    def vanished(path: Any) -> Any:
        if str(path).endswith("sub"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", vanished)
        assert manifest_files(tmp_path) == []


# -- A file rewritten in place (issue 18 item 4) -----------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_file_rewritten_in_place_is_read_only_once_settled(tmp_path: Path) -> None:
    """`kubectl get -o yaml > file`: truncated (empty for a while), then written in pieces. No
    poll in between withdraws a Service or delivers half the file."""
    f = tmp_path / "svc.yaml"
    full = service_yaml("a", 80) + "---\n" + service_yaml("b", 81)
    f.write_text(full)
    rec, clock = Recorder(), Clock()
    src = StaticSource(tmp_path, rec, clock=clock, settle=0.2, empty_settle=5.0)
    src.load_initial()
    seen: list[set[str]] = []

    def poll_for(seconds: float) -> None:
        for _ in range(int(seconds / 0.1)):
            clock.now += 0.1
            src.poll()
            seen.append({n.name for n in rec.services})

    with f.open("r+") as w:
        w.truncate(0)
        poll_for(3.0)  # the API call takes a while: the file stays empty
        half = service_yaml("a", 80) + "---\n"
        w.write(half)
        w.flush()
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))  # a distinct mtime per write
        clock.now += 0.1
        src.poll()
        seen.append({n.name for n in rec.services})
        w.write(full[len(half):].replace("81", "82"))
    poll_for(1.0)
    assert all(s == {"a", "b"} for s in seen), seen
    assert ports(rec, "b") == [82]


def test_a_file_rewritten_in_place_left_empty_is_believed_after_it_settles(tmp_path: Path) -> None:
    f = tmp_path / "svc.yaml"
    f.write_text(service_yaml("a", 80))
    rec, clock = Recorder(), Clock()
    src = StaticSource(tmp_path, rec, clock=clock, settle=0.2, empty_settle=5.0)
    src.load_initial()
    f.write_text("")
    for _ in range(49):
        clock.now += 0.1
        src.poll()
        assert {n.name for n in rec.services} == {"a"}
    clock.now += 0.2
    assert src.poll() and rec.services == {}


def test_a_file_rewritten_in_place_while_read_is_read_again(tmp_path: Path, monkeypatch: Any) -> None:
    """A file that changes while it is read (its stat key differs after the read) is not taken."""
    import usproxy.model.manifest as manifest
    import usproxy.sources.static as static

    f = tmp_path / "svc.yaml"
    f.write_text(service_yaml("a", 80))
    rec = Recorder()
    src = StaticSource(tmp_path, rec, settle=0.0)
    src.load_initial()
    rename_into(f, service_yaml("a", 81) + "---\n")
    real = manifest.load_file

    def load_then_append(path: Path, *parser: Any) -> Any:
        out = real(path, *parser)
        with path.open("a") as w:
            w.write(service_yaml("b", 82))
        return out
    monkeypatch.setattr(static, "load_file", load_then_append)
    assert not src.poll() and ports(rec, "a") == [80]
    monkeypatch.setattr(static, "load_file", real)
    assert src.poll() and ports(rec, "a") == [81] and ports(rec, "b") == [82]


def test_a_file_rewritten_in_place_but_replaced_by_rename_is_read_at_once(tmp_path: Path) -> None:
    """An atomic rename (a new inode) is complete by construction: no settle wait, even when it
    empties the file."""
    f = tmp_path / "svc.yaml"
    f.write_text(service_yaml("a", 80))
    rec, clock = Recorder(), Clock()
    src = StaticSource(tmp_path, rec, clock=clock, settle=0.2, empty_settle=5.0)
    src.load_initial()
    rename_into(f, service_yaml("a", 81))
    assert src.poll() and ports(rec, "a") == [81]
    rename_into(f, "kind: List\nitems: []\n")
    assert src.poll() and rec.services == {}


async def test_cancelled_as_a_change_wakes_it_the_source_ends(tmp_path: Path) -> None:
    """The agent's exit cancels the source; when an inotify wake-up lands in the same turn of the
    loop (a file written just before SIGTERM), the source still ends (asyncio.wait_for on 3.11
    swallowed such a cancellation, and the exit waited forever)."""
    (tmp_path / "a.yaml").write_text(service_yaml("a", 80))
    src = StaticSource(tmp_path, Recorder(), poll_interval=3600)
    src.load_initial()
    task = asyncio.create_task(src.run())
    await asyncio.sleep(0.05)
    src.request_reload()  # the wake-up, as inotify's
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done and task.cancelled()
