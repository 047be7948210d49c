"""A ServicePort on 127.0.0.1 and clients of it, for the relay tests that need no namespace
(test_tcp_listener, test_stop_refuses_late_connections): its state with given endpoints, clients
whose handshake the kernel completed, and what each of them meets (reset, empty, data or hang).
Each test runs on both event loops (`run`)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName

CLIENTS = 32


HANG = 2.0  # seconds without an answer that count as a hang (C01 allows 1 s for a refusal)


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def state(port: int, endpoints: tuple[Endpoint, ...]) -> ServicePortState:
    spn = ServicePortName("default", "web", "http", "TCP")
    sp = ServicePort(spn, (ipaddress.ip_address("127.0.0.1"),), port, 8080)
    return ServicePortState(sp, endpoints, endpoints, endpoints)


def connected(port: int) -> socket.socket:
    """A client whose handshake the kernel completed (it waits in the accept queue)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    s.setblocking(False)
    return s


async def outcome(s: socket.socket) -> str:
    """reset, empty (FIN: accept-then-close), data, or hang."""
    try:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(s, 1), HANG)
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "hang"
    finally:
        s.close()
    return "data" if data else "empty"


def run(loop: str, main: Callable[[], Coroutine[Any, Any, list[str]]]) -> list[str]:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main())
