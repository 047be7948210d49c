"""Prefetch (usproxy/sources/parse_helper.py): manifests read at start and partly parsed by a
forked child give the static source exactly what it reads alone (objects, errors, skipped
Services), across the files of a directory, also when the child dies before it delivers; the
child is always reaped and never outlives its agent; small manifests fork nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.sources.conftest import Recorder
from usproxy.sources.parse_helper import Prefetch
from usproxy.sources.static import StaticSource
from usproxy.util.errors import ConfigError


def objects(first: int, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(first, first + n):
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"s{i}", "namespace": "ns"},
                    "spec": {"clusterIP": f"10.96.{i // 250}.{i % 250 + 1}",
                             "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})
        out.append({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                    "metadata": {"name": f"s{i}-1", "namespace": "ns", "labels": {"kubernetes.io/service-name": f"s{i}"}},
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                    "endpoints": [{"addresses": [f"10.244.{i // 250}.{i % 250 + 1}"], "conditions": {"ready": True}}]})
    out[2]["spec"]["ports"][0]["port"] = "eighty"  # a bad object near the start
    out[-2]["metadata"]["name"] = "Bad_Name"  # and one near the end
    out[len(out) // 2]["spec"]["type"] = "ExternalName"  # skipped
    return out


def write_list(path: Path, objs: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}, sort_keys=False))


def load(path: Path, prefetch: Prefetch | None) -> tuple[Recorder, list[str]]:
    errors: list[ConfigError] = []
    rec = Recorder()
    StaticSource(path, rec, on_error=errors.append).load_initial(prefetch)
    return rec, sorted(str(e) for e in errors)


def reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.parametrize("kill", [False, True])
def test_a_directory_read_with_the_helper_gives_what_the_source_reads_alone(tmp_path: Path, kill: bool) -> None:
    for k in range(3):
        write_list(tmp_path / f"m{k}.yaml", objects(100 * k, 60))
    prefetch = Prefetch.start(tmp_path, share=0.6, least=0)
    assert prefetch is not None and prefetch.pid > 0
    pid = prefetch.pid
    assert prefetch.starts[tmp_path / "m0.yaml"] == len(prefetch.texts[tmp_path / "m0.yaml"][1]) + 1  # m0: all here
    assert 0 < prefetch.starts[tmp_path / "m1.yaml"] < len(prefetch.texts[tmp_path / "m1.yaml"][1])  # m1: split
    assert prefetch.starts[tmp_path / "m2.yaml"] == 0  # m2: all the child's
    if kill:  # dies before it delivers: the parent parses its part too
        os.kill(pid, signal.SIGKILL)
    helped, helped_errors = load(tmp_path, prefetch)
    alone, alone_errors = load(tmp_path, None)
    assert helped.services == alone.services and helped.slices == alone.slices and len(alone.services) == 3 * (60 - 3)
    assert helped_errors == alone_errors and len(alone_errors) == 6
    assert reaped(pid) and prefetch.pid == 0


def test_the_child_is_stopped_and_reaped_when_the_agent_ends_first(tmp_path: Path) -> None:
    write_list(tmp_path / "m.yaml", objects(0, 100))
    prefetch = Prefetch.start(tmp_path / "m.yaml", least=0)
    assert prefetch is not None
    pid = prefetch.pid
    prefetch.close()
    assert reaped(pid)


def test_small_or_unreadable_manifests_fork_nothing(tmp_path: Path) -> None:
    write_list(tmp_path / "m.yaml", objects(0, 10))
    assert Prefetch.start(tmp_path / "m.yaml") is None  # below MIN_BYTES
    assert Prefetch.start(tmp_path / "missing.yaml", least=0) is None
    (tmp_path / "bad.yaml").write_bytes(b"\xff\xfe")
    assert Prefetch.start(tmp_path, least=0) is None  # the source reports it


def test_the_child_ends_with_an_agent_killed_during_its_start(tmp_path: Path) -> None:
    """An agent killed before its source took the manifests (SIGKILL: no handler runs) leaves no
    child parsing on (PR_SET_PDEATHSIG)."""
    write_list(tmp_path / "m.yaml", objects(0, 2000))
    # the child's parse never ends by itself here, whether the agent dies before or after the
    # child asked for PDEATHSIG (before: the child finds it has another parent and exits)
    code = ("import sys, time; from pathlib import Path; import usproxy.sources.parse_helper as h; "
            "h.parse_share = lambda *a: time.sleep(600); "
            f"p = h.Prefetch.start(Path({str(tmp_path / 'm.yaml')!r}), least=0); print(p.pid, flush=True); time.sleep(60)")
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert agent.stdout is not None
        child = int(agent.stdout.readline())
        agent.kill()
        agent.wait()
        for _ in range(500):
            if not Path(f"/proc/{child}").exists() or "State:\tZ" in Path(f"/proc/{child}/status").read_text():
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the parse helper outlived its agent")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
