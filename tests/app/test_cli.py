"""The CLI: a manifest that cannot be parsed gives exit 2 naming the problem; missing input is a
usage error; `usproxy check` prints its table; a closed stdout ends a command quietly; status/flows without an agent exit 1.

No test here meets a real agent's state: `run` gets an interface name of its own and no offload,
so the per-namespace locks it takes before reading its input (usproxy/util/locks.py NetnsLock) are its
own, and `check` probes in a network namespace of its own.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.helpers import service_row

USPROXY = [sys.executable, "-m", "usproxy"]
OWN_LOCKS = ("--offload", "none", "--vip-interface", f"usp-t{secrets.token_hex(3)}")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*USPROXY, *args], capture_output=True, text=True, timeout=60)


def test_garbage_file_exits_2_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: v1\nkind: Service\n  metadata: [\n")
    res = run("run", "--services", str(f), "--healthz-bind-address", "127.0.0.1:0",
              "--metrics-bind-address", "127.0.0.1:0", *OWN_LOCKS)
    assert res.returncode == 2
    assert f"{f}: cannot parse" in res.stderr


def test_missing_path_exits_2_in_one_line(tmp_path: Path) -> None:
    """Checked before the agent logs anything (a fresh user saw an INFO line first)."""
    res = run("run", "--services", str(tmp_path / "nope"), *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr == f"usproxy: {tmp_path / 'nope'}: no such file or directory\n"


def test_a_config_error_names_usproxy_once() -> None:
    res = run("explain")
    assert res.returncode == 2
    assert res.stderr == "usproxy explain: --services: required (or --kubeconfig)\n"
    res = run("run", "--nodeport-addresses", "primary,10.0.0.0/8", *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr.startswith("usproxy run: --nodeport-addresses: ")


@pytest.mark.parametrize("flag, value, says", [
    ("--bpf-map-dynamic-size-ratio", "1.5", "must be between 0.0 and 1.0, got 1.5"),
    ("--bpf-ct-global-tcp-max", "100", "must be 0 (sized to the memory) or between 1024 and 16777216, got 100"),
    ("--bpf-lb-map-max", "0", "must be between 1 and 16777216, got 0"),
    ("--bpf-fragments-map-max", "100000", "must be between 256 and 65536, got 100000"),
])
def test_a_bpf_map_size_out_of_bounds_exits_2_naming_the_flag(flag: str, value: str, says: str) -> None:
    res = run("run", flag, value, *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr == f"usproxy run: {flag}: {says}\n"


@pytest.mark.parametrize("value", ["0x3000", "-1", "0x100000000"])
def test_a_hairpin_mark_of_more_than_one_bit_exits_2(value: str) -> None:
    res = run("run", "--hairpin-mark", value, *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr.startswith("usproxy run: --hairpin-mark: must be one bit"), res.stderr


def test_a_hairpin_mark_that_is_not_a_number_says_what_it_expects() -> None:
    res = run("run", "--hairpin-mark", "zz", *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr == ("usproxy run: error: argument --hairpin-mark: expected an integer "
                                                  "(4096, 0x1000), got 'zz' (see usproxy run --help)\n"), res.stderr


def test_a_bad_nodeport_cidr_is_named_once() -> None:
    res = run("run", "--nodeport-addresses", "300.1.1.1/8", *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr == ("usproxy run: --nodeport-addresses: '300.1.1.1/8' does not appear "
                                                  "to be an IPv4 or IPv6 network\n"), res.stderr


def test_a_config_files_unknown_mode_exits_2_before_anything_starts(tmp_path: Path) -> None:
    """`mode: bogus` in --config was ignored and the agent started on the ladder (BPF on the host's
    cgroup, for a user who had asked for something else): now refused as kube-proxy refuses it."""
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\nmode: bogus\n")
    res = run("run", "--config", str(f), *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"usproxy: KubeProxyConfiguration {f}: mode: must be iptables, ipvs, nftables, "
                                 "userspace or blank"), res.stderr


def test_missing_cluster_cidr_is_logged_once(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: v1\nkind: Service\n  metadata: [\n")  # the agent starts, logs, then exits 2 on it
    res = run("run", "--services", str(f), "--healthz-bind-address", "127.0.0.1:0",
              "--metrics-bind-address", "127.0.0.1:0", *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr.count("no --cluster-cidr") == 1, res.stderr


@pytest.mark.netns
def test_check_prints_table() -> None:
    res = subprocess.run(["unshare", "--net", *USPROXY, "check"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    for cap in ("interface bridge", "nftables", "bpf cgroup hooks", "bpf tc attach", "bpf map sizes", "conntrack"):
        assert cap in res.stdout


def test_status_without_agent_exits_1() -> None:
    res = run("status", "--metrics-bind-address", "127.0.0.1:1")
    assert res.returncode == 1 and "cannot reach the agent" in res.stderr


def test_explain_takes_options_after_the_subcommand() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    res = run("explain", "--services", str(examples), "--mode", "iptables")
    assert res.returncode == 0 and "KUBE-SERVICES" in res.stdout


def test_a_reader_that_closes_stdout_ends_the_command_quietly_with_exit_0() -> None:
    """`usproxy ... | head -1`: the write to a closed pipe is no "cannot reach the agent"."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    proc = subprocess.Popen([*USPROXY, "explain", "--services", str(examples)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    with proc.stderr:
        stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert stderr == ""


def test_status_table_says_which_datapath_serves_external_traffic_and_why() -> None:
    from usproxy.util.table import render_services

    row = service_row(node_port=30080, datapath="bpf", reason="established 1.0s ago", external="tc",
                      external_reason="tc (tcx) on eth0")
    header, line = render_services([row, {**row, "nodePort": 0, "external": None, "externalReason": ""}]).split("\n")[:2]
    assert header.split() == ["SERVICE", "PORT", "PROTO", "CLUSTER-IP:PORT", "NODEPORT", "ENDPOINTS", "DATAPATH",
                              "EXTERNAL", "WHY"]
    assert line.split()[5:7] == ["bpf", "tc"] and line.endswith("established 1.0s ago; external: tc (tcx) on eth0")
    assert render_services([{**row, "external": None, "externalReason": ""}]).split("\n")[1].split()[6] == "-"


@pytest.mark.parametrize("argv,named", [
    (["run", "--offload", "bogus"], "argument --offload: invalid choice: 'bogus'"),
    (["explain", "--mode", "foo"], "argument --mode: invalid choice: 'foo'"),
    (["explain", "--scale", "abc"], "argument --scale: must be a whole number of Services, got 'abc'"),
    (["explain", "trace"], "the following arguments are required: SRC"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
])
def test_a_usage_error_is_one_line_naming_the_argument(argv: list[str], named: str) -> None:
    """argparse's usage block is not printed (32 lines for `run`): one line, exit 2."""
    res = run(*argv)
    assert res.returncode == 2, res
    assert res.stderr.count("\n") == 1 and named in res.stderr and "--help)" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("flag", ["--healthz-bind-address", "--metrics-bind-address"])
@pytest.mark.parametrize("addr", ["127.0.0.1:notaport", "a b:80", "300.1.1.1:99"])
def test_a_bad_bind_address_exits_2_naming_the_flag(flag: str, addr: str) -> None:
    """`run` reads its bind addresses as status/flows read theirs, before anything starts."""
    res = run("run", flag, addr, *OWN_LOCKS)
    assert res.returncode == 2 and res.stderr == (
        f"usproxy run: {flag}: expected HOST:PORT (a name, an IPv4 address or [an IPv6 address], and a port), "
        f"got {addr!r}\n"), res.stderr


@pytest.mark.parametrize("name", ["thisnameiswaytoolongforlinux", "a/b", "a:b", "a b", "", "..", "sixteen-chars-xx"])
def test_a_vip_interface_that_cannot_be_an_interface_name_exits_2(name: str) -> None:
    """The kernel refuses such a name (dev_valid_name); before, the agent fell back to lo and
    left the ClusterIPs there, which --cleanup did not remove."""
    res = run("run", *OWN_LOCKS, "--vip-interface", name)
    assert res.returncode == 2 and res.stderr == (
        "usproxy run: --vip-interface: not a network interface name (1-15 characters, no '/', ':' or space), "
        f"got {name!r}\n"), res.stderr


def test_a_fifteen_character_vip_interface_name_is_taken() -> None:
    from usproxy.app.cli import _interface_name_ok

    assert _interface_name_ok("fifteen-chars-x") and _interface_name_ok("usproxy0")


@pytest.mark.parametrize("command", [["status"], ["flows"], ["explain", "--live"]])
@pytest.mark.parametrize("addr", ["127.0.0.1:notaport", "127.0.0.1:99999", "nocolon", "a b:80", "[zz]:80"])
def test_a_bad_agent_address_is_a_usage_error(command: list[str], addr: str) -> None:
    """status, flows and explain --live check --metrics-bind-address before any connection: one
    line naming the flag, exit 2 (it was a 45-line traceback for a port that is not a number)."""
    res = run(*command, "--metrics-bind-address", addr)
    assert res.returncode == 2, res
    prog = "usproxy " + command[0]
    assert res.stderr == (f"{prog}: error: argument --metrics-bind-address: expected HOST:PORT (a name, an IPv4 "
                          f"address or [an IPv6 address], and a port), got {addr!r} (see {prog} --help)\n")


@pytest.mark.parametrize("addr", ["127.0.0.1:1", "localhost:1", "[::1]:1"])
def test_a_good_agent_address_is_dialled(addr: str) -> None:
    res = run("status", "--metrics-bind-address", addr)
    assert res.returncode == 1 and "cannot reach the agent" in res.stderr and "Connection refused" in res.stderr
