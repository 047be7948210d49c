"""The admin servers' send timeout (usproxy/admin/send_watch.py), on both event loops over loopback:
a client that asks for a large answer and never reads is reset once the answer made no progress
for the timeout; a client reading slowly keeps its connection; the check's own rule on sizes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import uvloop
from aiohttp import web

from usproxy.admin.send_watch import SendWatch

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
PART = 256 * 1024
ANSWER = 64 * 1024 * 1024  # far more than the kernel's buffers take


async def stream(request: web.BaseRequest) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.content_length = ANSWER
    await resp.prepare(request)
    for _ in range(ANSWER // PART):
        await resp.write(bytes(PART))
    return resp


def asking(port: int, rcvbuf: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: usproxy\r\n\r\n")
    s.setblocking(False)
    return s


def read_some(s: socket.socket) -> int:
    try:
        return len(s.recv(16 * 1024))
    except BlockingIOError:
        return 0


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_client_that_never_reads_is_reset_a_slow_reader_is_not(loop_name: str) -> None:
    async def scenario() -> tuple[int, list[int], int, int, str]:
        server = web.Server(stream, access_log=None)
        listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        watch = SendWatch(lambda: server.connections, "test", timeout=1.0, period=0.1)
        watch.start()
        stalled, slow = asking(port, 4096), asking(port, 4096)
        read = 0
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:  # three timeouts
                read += read_some(slow)  # 16 KiB every 50 ms: far less than the answer's rate
                await asyncio.sleep(0.05)
            peers = [h.transport.get_extra_info("peername")[1] for h in server.connections if h.transport]
            try:
                while stalled.recv(PART):
                    pass
                end = "eof"
            except BlockingIOError:
                end = "open"
            except ConnectionResetError:
                end = "reset"
            return watch.aborted, peers, slow.getsockname()[1], read, end
        finally:
            await watch.stop()
            stalled.close()
            slow.close()
            listener.close()
            await server.shutdown(0.1)

    loop = LOOPS[loop_name]()
    try:
        aborted, peers, slow_port, read, end = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert aborted == 1 and peers == [slow_port], (aborted, peers)  # only the slow reader's is left
    assert read > 256 * 1024 and end == "reset", (read, end)


class FakeTransport:
    def __init__(self, size: int) -> None:
        self.size = size
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.size

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str) -> object:
        return None

    def abort(self) -> None:
        self.aborted = True


class FakeHandler:
    def __init__(self, size: int) -> None:
        self.transport = FakeTransport(size)


def test_only_an_unchanged_non_empty_buffer_counts_as_stalled() -> None:
    empty, moving, stuck = FakeHandler(0), FakeHandler(100), FakeHandler(100)
    watch = SendWatch(lambda: [empty, moving, stuck], "test", timeout=10.0)  # type: ignore[list-item]
    assert watch.check(now=0.0) == 0
    moving.transport.size = 50  # the client read; the handler wrote its next part
    assert watch.check(now=9.0) == 0
    moving.transport.size = 120
    assert watch.check(now=10.0) == 1  # stuck: 100 bytes, unchanged for 10 s
    assert (empty.transport.aborted, moving.transport.aborted, stuck.transport.aborted) == (False, False, True)
    assert watch.check(now=19.5) == 0 and watch.check(now=20.0) == 1  # moving stalled since 10.0
    assert watch.aborted == 2
