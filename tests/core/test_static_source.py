"""The static source: atomic renames and in-place edits are picked up, a directory's files merge,
a removed file withdraws its objects, SIGHUP forces a reload, and a broken edit keeps that file's
last good state while the other files keep working."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from usproxy.endpoint_slice import EndpointSlice
from usproxy.service import Service
from usproxy.sources.static import StaticSource, watch_sighup
from usproxy.types import NamespacedName


class Recorder:
    def __init__(self) -> None:
        self.services: dict[NamespacedName, Service] = {}
        self.slices: dict[NamespacedName, EndpointSlice] = {}
        self.synced = 0

    def on_service_update(self, previous: Service | None, current: Service | None) -> None:
        if current is None:
            assert previous is not None
            del self.services[previous.name]
        else:
            self.services[current.name] = current

    def on_endpoint_slice_update(self, previous: EndpointSlice | None, current: EndpointSlice | None) -> None:
        if current is None:
            assert previous is not None
            del self.slices[previous.name]
        else:
            self.slices[current.name] = current

    def on_services_synced(self) -> None:
        self.synced += 1

    def on_endpoint_slices_synced(self) -> None:
        self.synced += 1


def service(name: str, port: int) -> str:
    return (f"apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\n"
            f"spec: {{clusterIP: 10.96.0.{port % 250 + 1}, ports: [{{port: {port}}}]}}\n")


def ports(rec: Recorder, name: str) -> list[int]:
    return [sp.port for sp in rec.services[NamespacedName("default", name)].ports.values()]


def rename_into(path: Path, text: str) -> None:
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text(text)
    os.rename(tmp, path)


def test_directory_merge_rename_edit_and_removal(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(service("a", 80))
    (tmp_path / "b.yml").write_text(service("b", 81))
    (tmp_path / "notes.txt").write_text("not a manifest")
    rec = Recorder()
    src = StaticSource(tmp_path, rec)
    src.load_initial()
    assert rec.synced == 2 and set(n.name for n in rec.services) == {"a", "b"}
    rename_into(tmp_path / "a.yaml", service("a", 90))
    assert src.poll() and ports(rec, "a") == [90]
    (tmp_path / "b.yml").write_text(service("b", 91) + "# longer\n")  # edit in place
    assert src.poll() and ports(rec, "b") == [91]
    (tmp_path / "b.yml").unlink()
    assert src.poll() and set(n.name for n in rec.services) == {"a"}
    assert not src.poll()  # nothing changed: nothing delivered


def test_broken_edit_keeps_last_good_state_of_that_file_only(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(service("a", 80))
    (tmp_path / "b.yaml").write_text(service("b", 81))
    errors = []
    rec = Recorder()
    src = StaticSource(tmp_path, rec, on_error=errors.append)
    src.load_initial()
    rename_into(tmp_path / "a.yaml", "kind: Service\n  broken: [")
    rename_into(tmp_path / "b.yaml", service("b", 82))
    src.poll()
    assert ports(rec, "a") == [80] and ports(rec, "b") == [82]
    assert "a.yaml: cannot parse" in str(errors[0])


async def test_sighup_forces_a_reload(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text(service("a", 80))
    rec = Recorder()
    src = StaticSource(tmp_path, rec, poll_interval=3600)  # polling would never notice in time
    src.load_initial()
    st = f.stat()
    f.write_text(service("a", 88))
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


async def test_a_failing_scan_keeps_state_and_the_loop_alive(tmp_path: Path, monkeypatch: Any) -> None:
    import usproxy.sources.static as static

    (tmp_path / "a.yaml").write_text(service("a", 80))
    rec = Recorder()
    src = StaticSource(tmp_path, rec, poll_interval=0.01)
    src.load_initial()
    real = static.manifest_files
    calls = [0]

    def flaky(path: Path) -> list[Path]:
        calls[0] += 1
        if calls[0] <= 3:
            raise OSError(24, "Too many open files")
        return real(path)
    monkeypatch.setattr(static, "manifest_files", flaky)
    task = asyncio.create_task(src.run())
    try:
        rename_into(tmp_path / "a.yaml", service("a", 99))
        for _ in range(200):
            if ports(rec, "a") == [99]:
                break
            await asyncio.sleep(0.01)
        assert calls[0] > 3 and ports(rec, "a") == [99] and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
