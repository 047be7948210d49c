"""Each ordinary mistake ends in one clear line on stderr and a documented exit code, never a
traceback (issue 27 item 7): an admin port already in use (1), a user without root and root
without CAP_NET_ADMIN (1, "not permitted"), a lock file that cannot be made (1), `usproxy check`
without privileges ("not permitted", 1), `explain --html` into a missing directory (2), a
manifest object whose kind is misspelt or missing (2 in explain; logged, counted and skipped by
the agent), and /healthz saying what fails while syncs fail. Agents run in a throwaway network
namespace."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import inside, sh
from tests.relay.harness import USPROXY
from usproxy.admin.health import evaluate
from usproxy.app.privileges import has_net_admin
from usproxy.model.manifest import objects_from, parse_documents
from usproxy.util import locks
from usproxy.util.errors import CannotRun

ROOT = Path(USPROXY).parents[2]
EXAMPLE = ROOT / "examples" / "services.yaml"
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
NO_NET_ADMIN = ("setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin")


@pytest.fixture
def netns() -> Iterator[str]:
    import secrets

    name = f"usp{secrets.token_hex(3)}-fail"
    sh("ip", "netns", "add", name)
    sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    try:
        yield name
    finally:
        sh("ip", "netns", "del", name, check=False)


def usproxy(netns: str, *args: str, wrap: tuple[str, ...] = (), timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--net=/run/netns/{netns}", *wrap, USPROXY, *args],
                          capture_output=True, text=True, timeout=timeout)


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.netns
def test_admin_port_in_use(netns: str) -> None:
    with inside(netns):
        holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        proc = usproxy(netns, "run", "--services", str(EXAMPLE), "--offload", "none",
                       "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", f"127.0.0.1:{port}")
    finally:
        holder.close()
    assert proc.returncode == 1
    assert last_line(proc) == (f"usproxy: --metrics-bind-address 127.0.0.1:{port}: cannot listen: Address already "
                               "in use (another kube-proxy or usproxy serves it? stop it, or give another port)")


@pytest.mark.netns
def test_an_admin_address_whose_name_does_not_resolve_says_why(netns: str) -> None:
    """A name the resolver cannot find: the resolver's own words, not "Unknown error -3"."""
    proc = usproxy(netns, "run", "--services", str(EXAMPLE), "--offload", "none",
                   "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "no-such-host.invalid:10249")
    assert proc.returncode == 1
    line = last_line(proc)
    assert line.startswith("usproxy: --metrics-bind-address no-such-host.invalid:10249: cannot listen: "), line
    assert "Unknown error" not in line and line.rsplit(": ", 1)[1].strip(), line


@pytest.mark.netns
@pytest.mark.parametrize("who", [NOBODY, NO_NET_ADMIN], ids=["not-root", "root-without-net-admin"])
def test_without_net_admin_run_says_not_permitted(netns: str, who: tuple[str, ...]) -> None:
    for args, command in ((("run", "--services", str(EXAMPLE)), "usproxy run"), (("run", "--cleanup"), "usproxy run --cleanup")):
        proc = usproxy(netns, *args, wrap=who)
        assert proc.returncode == 1, proc.stderr
        assert last_line(proc) == (f"{command}: not permitted: this process lacks CAP_NET_ADMIN, which the "
                                   "ClusterIP interface, the listeners and the kernel tables need; run it as root, "
                                   "or add NET_ADMIN to the container's securityContext.capabilities")


@pytest.mark.netns
def test_check_without_privileges_says_not_permitted(netns: str) -> None:
    proc = usproxy(netns, "check", wrap=NO_NET_ADMIN)
    assert proc.returncode == 1
    assert last_line(proc) == ("usproxy check: not permitted: without CAP_NET_ADMIN the probes cannot tell "
                               "what this node supports; run it as root")
    dummy = next(line for line in proc.stdout.splitlines() if line.startswith("interface dummy"))
    assert "not permitted" in dummy and "driver" not in dummy
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert rows["nftables"].split(None, 2)[2].startswith("not permitted: needs CAP_NET_ADMIN")
    assert "probed without CAP_NET_ADMIN" in rows["iptables"]  # not read as missing matches
    assert proc.stderr.strip().splitlines() == [last_line(proc)]  # libnftables' own "(you must be root)" kept out


def test_lock_file_that_cannot_be_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(locks, "LOCK_DIR", blocked / "usproxy")  # under a file: cannot be made
    with pytest.raises(CannotRun, match=r"^cannot make the lock file .*/file/usproxy/netns-\d+-usproxy0.lock: "):
        locks.NetnsLock("usproxy0").acquire()


def test_explain_html_into_a_missing_directory(tmp_path: Path) -> None:
    out = tmp_path / "missing" / "x.html"
    proc = subprocess.run([USPROXY, "explain", "--services", str(EXAMPLE), "--html", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert last_line(proc) == (f"usproxy explain: --html: {out}: cannot write: No such file or directory "
                               f"(no directory {out.parent})")


MISSPELT = """
apiVersion: v1
kind: Servce
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings, namespace: default}
---
apiVersion: v1
metadata: {name: nameless-kind, namespace: default}
"""


def test_a_misspelt_or_missing_kind_names_the_object_and_field(tmp_path: Path) -> None:
    m = objects_from(parse_documents(MISSPELT))
    assert [str(e) for e in m.errors] == [
        "'Servce' default/web: kind: expected one of Service, EndpointSlice, ServiceCIDR, Node (other kinds "
        "are ignored), got 'Servce': did you mean Service?",
        "object default/nameless-kind: kind: required: expected one of Service, EndpointSlice, ServiceCIDR, "
        "Node (other kinds are ignored), got None"]  # the ConfigMap is ignored, as every other kind
    path = tmp_path / "m.yaml"
    path.write_text(MISSPELT)
    proc = subprocess.run([USPROXY, "explain", "--services", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "did you mean Service?" in proc.stderr and "Traceback" not in proc.stderr


def test_healthz_says_what_fails() -> None:
    failing = evaluate(100.0, None, 60.0, now=200.0, error="NetlinkError: (1, 'Operation not permitted')",
                       failing_since=130.0)
    assert failing.healthy is False  # failing for longer than the timeout, nothing queued
    assert failing.body()["lastSyncError"] == "NetlinkError: (1, 'Operation not permitted')"
    assert str(failing.body()["failingSince"]).startswith("1970-01-01 00:02:10")
    fresh = evaluate(100.0, None, 60.0, now=200.0, error="x", failing_since=190.0)
    assert fresh.healthy is True and "lastSyncError" in fresh.body()
    assert "lastSyncError" not in evaluate(100.0, None, 60.0, now=200.0).body()


def test_unknown_capabilities_leave_it_to_the_kernel() -> None:
    assert has_net_admin(Path("/nonexistent")) is True


@pytest.mark.netns
def test_run_without_a_source_says_so_before_anything_else(netns: str) -> None:
    """No --services, no --kubeconfig, not in a cluster: one line, exit 2, before any datapath is
    built (a fresh-user run saw two INFO lines from the offload set-up first)."""
    proc = usproxy(netns, "run")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["usproxy run: give --services PATH or --kubeconfig PATH"]


def test_explain_scale_that_is_not_a_number_is_named() -> None:
    proc = subprocess.run([USPROXY, "explain", "--services", str(EXAMPLE), "--scale", "abc"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["usproxy explain: error: argument --scale: must be a whole number of "
                                        "Services, got 'abc' (see usproxy explain --help)"]  # no usage block
