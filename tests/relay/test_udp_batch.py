"""UdpBatch (udp_batch.py): which datagrams join a batch, the buffer always has room for a whole
datagram, and a UDP_SEGMENT send arrives as the same datagrams (loopback, no netns needed)."""

from __future__ import annotations

import socket
from typing import Any

from usproxy.relay.udp_batch import MAX_DATAGRAM, MAX_SEGMENTS, UdpBatch, send_segments


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, bytes, int]] = []

    def __call__(self, target: Any, data: memoryview, segment: int) -> None:
        self.sent.append((target, bytes(data), segment))


def feed(batch: UdpBatch, rec: Recorder, key: Any, payload: bytes) -> None:
    """What the relay's callbacks do with one datagram read at `free`."""
    assert len(batch.free) == MAX_DATAGRAM  # a whole datagram always fits
    batch.free[:len(payload)] = payload
    if batch.count and batch.key != key:
        batch.cut()  # as the listener does before it looks the flow up
    batch.add(key, len(payload), rec, key)


def test_equal_datagrams_of_one_flow_make_one_batch_and_a_short_one_ends_it() -> None:
    batch, rec = UdpBatch(), Recorder()
    for i in range(5):
        feed(batch, rec, "a", bytes([i]) * 100)
    feed(batch, rec, "a", b"s" * 40)  # the last may be shorter
    feed(batch, rec, "a", b"t" * 40)  # nothing may follow a short one
    batch.flush()
    assert rec.sent == [("a", b"".join(bytes([i]) * 100 for i in range(5)) + b"s" * 40, 100),
                        ("a", b"t" * 40, 0)]


def test_another_flow_or_a_larger_datagram_flushes_first() -> None:
    batch, rec = UdpBatch(), Recorder()
    feed(batch, rec, "a", b"1" * 10)
    feed(batch, rec, "b", b"2" * 10)
    feed(batch, rec, "b", b"3" * 20)
    feed(batch, rec, "b", b"4" * 2000)  # above MAX_SEGMENT: never batched
    feed(batch, rec, "b", b"5" * 2000)
    batch.flush()
    assert [(t, len(d), s) for t, d, s in rec.sent] == [("a", 10, 0), ("b", 10, 0), ("b", 20, 0),
                                                       ("b", 2000, 0), ("b", 2000, 0)]


def test_a_batch_stops_at_the_kernels_limits() -> None:
    batch, rec = UdpBatch(), Recorder()
    for _ in range(MAX_SEGMENTS + 1):
        feed(batch, rec, "a", b"x" * 10)
    for _ in range(50):  # 50 × 1400 B > one IPv4 datagram
        feed(batch, rec, "b", b"y" * 1400)
    batch.flush()
    assert [(len(d) // max(1, s or len(d)), s) for _, d, s in rec.sent] == [
        (MAX_SEGMENTS, 10), (1, 0), (46, 1400), (4, 1400)]


def test_the_buffer_is_compacted_and_never_overruns() -> None:
    batch, rec = UdpBatch(), Recorder()
    feed(batch, rec, "a", b"a" * MAX_DATAGRAM)
    feed(batch, rec, "b", b"b" * 1000)  # read after a maximal datagram, then more of its flow
    for _ in range(40):
        feed(batch, rec, "b", b"b" * 1000)
    batch.flush()
    assert [(t, len(d), s) for t, d, s in rec.sent] == [("a", MAX_DATAGRAM, 0), ("b", 41_000, 1000)]


def test_a_segmented_send_arrives_as_separate_datagrams() -> None:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(2)
        payload = b"".join(bytes([i]) * 1200 for i in range(7)) + b"z" * 300
        send_segments(tx, memoryview(payload), 1200, rx.getsockname())
        got = [rx.recv(65535) for _ in range(8)]
    assert got == [bytes([i]) * 1200 for i in range(7)] + [b"z" * 300]


def test_a_dropped_datagram_is_overwritten_and_flush_empties_the_buffer() -> None:
    batch, rec = UdpBatch(), Recorder()
    feed(batch, rec, "a", b"1" * 100)
    batch.free[:100] = b"9" * 100  # read, but no flow took it (dropped): not added
    feed(batch, rec, "a", b"2" * 100)
    batch.flush()
    assert rec.sent == [("a", b"1" * 100 + b"2" * 100, 100)]
    assert (batch.count, batch.start, batch.end, len(batch.free)) == (0, 0, 0, MAX_DATAGRAM)
