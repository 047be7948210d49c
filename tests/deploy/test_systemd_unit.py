"""deploy/: the systemd unit and the default /etc/usproxy layout of an edge device.

- `systemd-analyze verify` accepts usproxy.service without a single warning (unknown keys and
  bad values are only warnings to it), with /opt/usproxy/bin/usproxy present: an executable
  stands in for the installed wheel on a tmpfs over /opt, in a private mount namespace, so the
  machine's /opt is never touched.
- ExecStart, with the unit's Environment= substituted, parses with usproxy's own CLI over the
  default config.yaml: the static source on services.d, the KubeProxyConfiguration's values.
- ExecReload, run as systemd would, makes the static source reload; the unit grants the same three
  capabilities as the DaemonSet, makes the system read-only, and logs to the journal.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from tests.deploy.image import ROOT
from tests.deploy.manifests import daemonset
from tests.deploy.pod import container
from usproxy.app.cli import build_parser, config_from_args
from usproxy.sources import static
from usproxy.util import cgroup2

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "usproxy.service"
LAYOUT = DEPLOY / "etc" / "usproxy"


def unit_entries() -> dict[str, list[str]]:
    """Key -> values in file order (a key may repeat), over every section."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def unit_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit_entries()["Environment"]:
        for word in shlex.split(value):
            key, _, val = word.partition("=")
            env[key] = val
    return env


def test_systemd_analyze_verify_passes_without_warnings(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a private mount namespace")
    unit = tmp_path / "usproxy.service"
    unit.write_text(UNIT.read_text())
    script = ("mount -t tmpfs tmpfs /opt && mkdir -p /opt/usproxy/bin"
              " && printf '#!/bin/sh\\n' >/opt/usproxy/bin/usproxy && chmod +x /opt/usproxy/bin/usproxy"
              f" && exec systemd-analyze verify {shlex.quote(str(unit))}")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == out.stderr == "", out.stdout + out.stderr


def test_exec_start_runs_the_static_source_over_the_default_layout(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (exec_start,) = unit_entries()["ExecStart"]
    env = unit_environment()
    argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start))
    assert argv[0] == "/opt/usproxy/bin/usproxy"  # the venv the README installs the wheel into
    local = {"/etc/usproxy/config.yaml": str(LAYOUT / "config.yaml"), "/etc/usproxy/services.d": str(LAYOUT / "services.d")}
    assert set(local) <= set(argv)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = config_from_args(build_parser().parse_args([local.get(a, a) for a in argv[1:]]))
    assert cfg.services == LAYOUT / "services.d" and cfg.kubeconfig is None
    assert cfg.healthz_bind_address == "127.0.0.1:10256" and cfg.metrics_bind_address == "127.0.0.1:10249"
    assert (cfg.sync_period, cfg.min_sync_period) == (30.0, 1.0)
    # no --bpf-cgroup: the agent finds cgroup v2 in the mount table, hybrid or alone
    assert "--bpf-cgroup" not in argv and cfg.bpf_cgroup == cgroup2.mount_point()
    # services.d ships without manifests: nothing in it is one (the README is not read)
    from usproxy.model.manifest import manifest_files

    assert manifest_files(LAYOUT / "services.d") == []


async def test_exec_reload_makes_the_static_source_reload() -> None:
    """The unit's ExecReload, run as systemd runs it ($MAINPID: this process), reaches the
    handler the agent installs for its static source (usproxy.sources.static.watch_sighup)."""
    (reload,) = unit_entries()["ExecReload"]
    reloaded = asyncio.Event()

    class Source:
        def request_reload(self) -> None:
            reloaded.set()

    static.watch_sighup(cast(Any, Source()))
    try:
        subprocess.run(shlex.split(reload.replace("$MAINPID", str(os.getpid()))), check=True, timeout=10)
        await asyncio.wait_for(reloaded.wait(), 5)
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)


def test_only_the_daemonsets_capabilities_a_read_only_system_and_the_journal() -> None:
    e = unit_entries()
    caps = sorted(f"CAP_{c}" for c in container(daemonset())["securityContext"]["capabilities"]["add"])
    assert sorted(e["AmbientCapabilities"][0].split()) == sorted(e["CapabilityBoundingSet"][0].split()) == caps
    assert e["NoNewPrivileges"] == ["yes"] and e["ProtectSystem"] == ["strict"]
    # what the agent writes under a read-only system: its lock files (usproxy/util/locks.py LOCK_DIR) and the cache
    from usproxy.util.locks import LOCK_DIR

    assert e["RuntimeDirectory"] == [LOCK_DIR.name] and str(LOCK_DIR) == "/run/usproxy"
    assert unit_environment()["USPROXY_BPF_CACHE"].startswith(f"/var/cache/{e['CacheDirectory'][0]}/")
    assert e["Restart"] == ["on-failure"]
    assert e["StandardOutput"] == e["StandardError"] == ["journal"]
