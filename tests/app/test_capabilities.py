"""`usproxy check`'s conntrack row (usproxy/app/capabilities.py) counts the entries it read, in
words a reader expects ("1 entry", "2 entries"), in a throwaway network namespace whose only
tracked flows are the datagrams this test sends."""

from __future__ import annotations

import secrets
import socket

from tests.netns import inside, nsexec, sh
from usproxy.app.capabilities import probe_conntrack


def _send_from(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", port))
        s.sendto(b"x", ("127.0.0.1", 9))  # nothing listens: the ICMP answer is RELATED, not a new entry


def test_conntrack_row_counts_entries_in_words() -> None:
    ns = "usp" + secrets.token_hex(3) + "-ct"  # no bridge: its multicast joins would be tracked too
    sh("ip", "netns", "add", ns)
    try:
        nsexec(ns, "ip", "link", "set", "lo", "up")
        # the kernel tracks flows in a namespace only while a rule there uses conntrack
        nsexec(ns, "nft", "add table ip usptrack; add chain ip usptrack out { type filter hook output priority 0; }; "
                      "add rule ip usptrack out ct state new accept")
        with inside(ns):
            empty = probe_conntrack()
            _send_from(40001)
            one = probe_conntrack()
            _send_from(40002)
            two = probe_conntrack()
    finally:
        sh("ip", "netns", "del", ns)
    assert (empty.available, empty.detail) == (True, "0 entries readable")
    assert one.detail == "1 entry readable"
    assert two.detail == "2 entries readable"
