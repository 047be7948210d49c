"""The relay's socket filter, on loopback sockets this test creates: the kernel delivers a datagram
from a source inside the ranges and drops one from outside, for IPv4 and IPv6 (prefixes inside a
word and across words), and detaching the filter lets all through; clauses by ingress interface
(`lo`, where these datagrams arrive) and conjunctions of clauses (a source range and "pods or the
node") decide as documented, and DROP_ALL drops everything."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import pytest

from usproxy.relay.source_filter import (DROP_ALL, LOOPBACK_IFINDEX, MAX_INSNS, Clause, allows, attach,
                                         attach_clauses, program, program_of)


@pytest.fixture
def v4() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(0.3)
    yield s
    s.close()


def delivered(rx: socket.socket, src: str) -> bool:
    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as tx:
        tx.bind((src, 0))
        tx.sendto(b"x", rx.getsockname()[:2])
    try:
        return rx.recv(16) == b"x"
    except socket.timeout:
        return False


def nets(*texts: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(t) for t in texts]


def test_ipv4_inside_delivered_outside_dropped(v4: socket.socket) -> None:
    attach(v4, nets("127.0.0.0/30", "127.9.9.9/32"))
    assert delivered(v4, "127.0.0.2")
    assert delivered(v4, "127.9.9.9")
    assert not delivered(v4, "127.0.0.5")
    attach(v4, [])  # no ranges: the filter is removed
    assert delivered(v4, "127.0.0.5")


def test_ipv6_prefixes_within_and_across_words() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as rx:
        try:
            rx.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
        rx.settimeout(0.3)
        attach(rx, nets("::1/128"))
        assert delivered(rx, "::1")
        attach(rx, nets("2001:db8::/32", "::/127"))  # ::1 is in ::/127 (fourth word, masked)
        assert delivered(rx, "::1")
        attach(rx, nets("2001:db8::/32", "::2/127"))
        assert not delivered(rx, "::1")


def test_too_many_ranges_are_refused_not_truncated() -> None:
    many = [ipaddress.ip_network(f"10.{i // 256}.{i % 256}.0/24") for i in range(MAX_INSNS // 4 + 1)]
    with pytest.raises(ValueError, match="BPF instructions"):
        program(many)


def test_allows_matches_the_program() -> None:
    ranges = nets("203.0.113.0/25")
    assert allows(ranges, "203.0.113.2") and not allows(ranges, "203.0.113.130")
    assert allows([], "198.51.100.7")
    assert not allows(ranges, "not an address")


def test_interface_clauses_and_their_conjunction(v4: socket.socket) -> None:
    attach_clauses(v4, (Clause((), (LOOPBACK_IFINDEX,)),))  # the node's own packets come in on lo
    assert delivered(v4, "127.0.0.5")
    attach_clauses(v4, (Clause((), (99999,)),))  # another interface only
    assert not delivered(v4, "127.0.0.5")
    attach_clauses(v4, (Clause(tuple(nets("10.0.0.0/8")), (99999,)),))  # neither the range nor the interface
    assert not delivered(v4, "127.0.0.5")
    both = (Clause(tuple(nets("127.0.0.0/30"))), Clause(tuple(nets("10.0.0.0/8")), (LOOPBACK_IFINDEX,)))
    attach_clauses(v4, both)  # a source range AND (a pod CIDR OR lo)
    assert delivered(v4, "127.0.0.2")
    assert not delivered(v4, "127.0.0.5")  # passes the second clause, not the first
    attach_clauses(v4, (Clause(tuple(nets("127.0.0.0/8"))), Clause(tuple(nets("10.0.0.0/8")))))
    assert not delivered(v4, "127.0.0.2")  # passes the first clause, not the second
    attach_clauses(v4, DROP_ALL)
    assert not delivered(v4, "127.0.0.2")
    attach_clauses(v4, ())
    assert delivered(v4, "127.0.0.2")


def test_one_range_is_the_same_program_as_one_clause() -> None:
    ranges = nets("203.0.113.0/25", "2001:db8::/32")[:1]
    assert program(ranges) == program_of((Clause(tuple(ranges)),))
