"""A TCP frontend whose ServicePort loses its last usable endpoint strands no client (C01).

Fault class: accept-then-hang (kube-proxy 1.0). When a listener closes because its ServicePort has
no usable endpoint any more, a connection the kernel already completed must end at once: reset
(or, once the listener is gone, refused), never left open with nobody reading it until the client
times out. Two moments, each on both event loops, with the N→0 change made by the real
ServicePortRelay on 127.0.0.1 (no namespace needed):
- the connections still wait in the listener's accept queue when it closes;
- the loop accepts them in the same iteration as the sync that closes the listener wakes up, so
  the sync runs between the accept and the hand-over of the accepted sockets (asyncio's own Server
  lost such sockets; this is the interleaving that left a C01 client hanging 3 s on a loaded machine).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from tests.relay.loopback_clients import CLIENTS, connected, free_port, outcome, run, state
from usproxy.flows.flow_table import FlowTable
from usproxy.model.endpoint import Endpoint
from usproxy.relay.flow_admission import FlowAdmission
from usproxy.relay.service_port_relay import ServicePortRelay
from usproxy.relay.udp import UdpRelay


async def serving(port: int) -> ServicePortRelay:
    """A ServicePortRelay listening on 127.0.0.1:port with one endpoint that refuses dials (so a
    connection can end only by a reset, whenever its dial runs)."""
    udp = UdpRelay(30.0)
    admission = FlowAdmission(FlowTable(1000), 1000, udp.evict_oldest)
    endpoint = Endpoint(ipaddress.ip_address("127.0.0.1"), free_port())
    relay = ServicePortRelay(state(port, (endpoint,)), admission=admission, udp=udp, listening=set(),
                             default_policy="roundRobin")
    await relay.apply(state(port, (endpoint,)), ())
    assert relay.listeners and not relay.errors
    return relay


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    return False


async def closed_with_a_full_queue() -> list[str]:
    port = free_port()
    relay = await serving(port)
    clients = [connected(port) for _ in range(CLIENTS)]
    await relay.apply(state(port, ()), ())  # no await inside suspends: nothing was accepted
    assert not relay.listeners and refused(port)
    return list(await asyncio.gather(*(outcome(s) for s in clients)))


async def closed_while_accepting() -> list[str]:
    port = free_port()
    relay = await serving(port)
    loop = asyncio.get_running_loop()
    wake = loop.create_future()

    async def sync_to_zero() -> None:
        await wake
        await relay.apply(state(port, ()), ())

    sync = loop.create_task(sync_to_zero())
    await asyncio.sleep(0)  # the sync now waits for `wake`
    clients = [connected(port) for _ in range(CLIENTS)]  # the listener is readable now
    # Scheduled before the loop's next poll, so it runs in the iteration that accepts the clients
    # and the sync's next step comes before anything that accept scheduled.
    loop.call_soon(wake.set_result, None)
    got = list(await asyncio.gather(*(outcome(s) for s in clients)))
    await sync
    assert not relay.listeners and refused(port)
    return got


def test_connections_queued_when_the_last_endpoint_goes_are_reset(loop_name: str) -> None:
    assert run(loop_name, closed_with_a_full_queue) == ["reset"] * CLIENTS


def test_connections_accepted_as_the_last_endpoint_goes_are_reset(loop_name: str) -> None:
    assert run(loop_name, closed_while_accepting) == ["reset"] * CLIENTS
