"""PortHolder on a /proc tree written here (no root, no netns): which socket and process hold a port."""

from __future__ import annotations

import os
from pathlib import Path

from usproxy.relay.port_holder import describe_holder, holding_sockets

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(local: str, state: str, inode: int) -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1\n"


def fake_proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(HEADER + row("00000000:08AE", "0A", 101)   # 0.0.0.0:2222 listening
                                      + row("0606600A:0050", "0A", 102)         # 10.96.6.6:80 listening
                                      + row("0606600A:1F90", "01", 103))        # 10.96.6.6:8080 established
    (proc / "net" / "tcp6").write_text(HEADER + row("00000000000000000000000000000000:1F91", "0A", 104))
    (proc / "net" / "udp").write_text(HEADER + row("0706600A:0035", "07", 105))  # 10.96.6.7:53
    for pid, comm, inode in ((812, "sshd", 101), (os.getpid(), "usproxy", 104)):
        fds = proc / str(pid) / "fd"
        fds.mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(comm + "\n")
        os.symlink(f"socket:[{inode}]", fds / "3")
    return proc


def test_port_holder_finds_wildcard_exact_and_dual_stack_holders(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    assert holding_sockets("10.96.6.6", 2222, "TCP", proc) == [("0.0.0.0", 101)]
    assert holding_sockets("10.96.6.6", 80, "TCP", proc) == [("10.96.6.6", 102)]
    assert holding_sockets("10.96.6.6", 8080, "TCP", proc) == []  # not listening: no conflict
    assert holding_sockets("10.96.6.6", 8081, "TCP", proc) == [("::", 104)]
    assert holding_sockets("10.96.6.7", 53, "UDP", proc) == [("10.96.6.7", 105)]
    assert holding_sockets("10.96.6.6", 53, "UDP", proc) == []


def test_port_holder_names_the_process(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    assert describe_holder("10.96.6.6", 2222, "TCP", proc) == "held by 0.0.0.0:2222 of pid 812 (sshd)"
    assert describe_holder("10.96.6.6", 8081, "TCP", proc) == f"held by [::]:8081 of this agent (pid {os.getpid()})"
    assert describe_holder("10.96.6.6", 80, "TCP", proc) == "held by 10.96.6.6:80 (process not visible)"
    assert describe_holder("10.96.6.6", 9999, "TCP", proc) == ""
