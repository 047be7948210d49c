"""A relay that stops refuses the connections it accepted but had not yet handed to a protocol.

Fault class: end-of-stream honesty at exit (as test_stop_resets_flows.py). `Relay.close` resets
every relayed TCP connection, but a connection the loop accepted in the same iteration as the stop
reaches its protocol only later (uvloop calls `connection_made` soon after the accept, asyncio
hands the socket over in a task): its flow was not in the table when the flows were reset, so it
was dialed and relayed after the stop, and the process's exit ended it with FIN, a clean EOF
after a cut stream (seen as a short download under a connect storm at SIGTERM). Now such a
connection is reset without a dial. Real Relay and ServicePortRelay on 127.0.0.1, both loops.
"""

from __future__ import annotations

import asyncio
import ipaddress

from tests.relay.loopback_clients import CLIENTS, connected, free_port, outcome, run, state
from usproxy.model.config import ProxyConfig
from usproxy.model.endpoint import Endpoint
from usproxy.model.node import NodeFacts
from usproxy.relay.relay import Relay, RelaySettings
from usproxy.relay.service_port_relay import ServicePortRelay


async def talker() -> tuple[asyncio.AbstractServer, Endpoint]:
    """An endpoint that greets every connection at once (a relayed client reads "data")."""
    async def greet(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hello")
        await r.read()
        w.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    return server, Endpoint(ipaddress.ip_address("127.0.0.1"), server.sockets[0].getsockname()[1])


async def stopped_while_accepting() -> list[str]:
    port = free_port()
    endpoint_server, endpoint = await talker()
    try:
        return await stop_while_accepting(port, endpoint)
    finally:
        endpoint_server.close()


async def stop_while_accepting(port: int, endpoint: Endpoint) -> list[str]:
    """Clients in the relay's accept queue as it stops: how each connection ends."""
    relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts())
    sp = ServicePortRelay(state(port, (endpoint,)), admission=relay.admission, udp=relay.udp,
                          listening=relay.listening, default_policy="roundRobin")
    await sp.apply(state(port, (endpoint,)), ())
    relay.ports[sp.spn] = sp
    loop = asyncio.get_running_loop()
    wake = loop.create_future()

    async def stop() -> None:
        await wake
        await relay.close()

    stopping = loop.create_task(stop())
    await asyncio.sleep(0)  # the stop now waits for `wake`
    clients = [connected(port) for _ in range(CLIENTS)]  # the listener is readable now
    loop.call_soon(wake.set_result, None)  # the stop runs after the accept, before the hand-over
    try:
        return list(await asyncio.gather(*(outcome(s) for s in clients)))
    finally:
        await stopping


def test_connections_accepted_as_the_relay_stops_are_reset(loop_name: str) -> None:
    got = run(loop_name, stopped_while_accepting)
    assert got == ["reset"] * CLIENTS, got
