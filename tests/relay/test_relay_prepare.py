"""Relay.prepare (issue 30): the agent starts the relay while its source makes the first list. In
a throwaway network namespace, on both event loops: the start runs once, in the background, and
the first sync waits for it; a close during it closes what it made; a failed start fails the sync
that waited, and the next sync starts again."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tests.netns import Topology, inside, nsexec
from tests.relay.test_deferred_listeners import Vip, listening, state
from usproxy.core.datapath import SyncRequest
from usproxy.model.config import ProxyConfig
from usproxy.model.node import NodeFacts
from usproxy.relay.relay import Relay, RelaySettings


class SlowVip(Vip):
    """setup waits for `gate`; it fails while `fail` is set; calls are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.fail = False
        self.setups = 0
        self.closed = 0

    async def setup(self) -> None:
        self.setups += 1
        await self.gate.wait()
        if self.fail:
            raise OSError(1, "Operation not permitted")

    async def close(self) -> None:
        self.closed += 1


def run(loop_name: str, coro_fn: object) -> None:
    (uvloop.run if loop_name == "uvloop" else asyncio.run)(coro_fn())  # type: ignore[operator]


def test_the_first_sync_waits_for_the_start_prepare_began(topology: Topology, loop_name: str) -> None:
    async def body() -> None:
        nsexec(topology.node, "ip", "addr", "add", "10.96.79.1/32", "dev", "lo")
        with inside(topology.node):
            vip = SlowVip()
            relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
            try:
                relay.prepare()
                relay.prepare()
                sync = asyncio.ensure_future(relay.sync(SyncRequest(dict([state("a", "10.96.79.1")]))))
                await asyncio.sleep(0.05)
                assert vip.setups == 1 and not sync.done()  # the sync waits for the start under way
                vip.gate.set()
                await asyncio.wait_for(sync, 5)
                assert vip.setups == 1 and listening(relay, "10.96.79.1")
            finally:
                await relay.close()
            assert vip.closed == 1
    run(loop_name, body)


def test_a_close_during_the_start_closes_what_it_made(topology: Topology, loop_name: str) -> None:
    async def body() -> None:
        with inside(topology.node):
            vip = SlowVip()
            relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
            relay.prepare()
            await asyncio.sleep(0.01)
            asyncio.get_running_loop().call_later(0.05, vip.gate.set)
            await asyncio.wait_for(relay.close(), 5)
            assert vip.setups == 1 and vip.closed == 1
    run(loop_name, body)


def test_a_failed_start_fails_the_sync_and_the_next_one_starts_again(topology: Topology, loop_name: str) -> None:
    async def body() -> None:
        nsexec(topology.node, "ip", "addr", "add", "10.96.79.2/32", "dev", "lo")
        with inside(topology.node):
            vip = SlowVip()
            vip.fail = True
            vip.gate.set()
            relay = Relay(RelaySettings.from_config(ProxyConfig()), NodeFacts(), vip=vip)  # type: ignore[arg-type]
            try:
                relay.prepare()
                request = SyncRequest(dict([state("b", "10.96.79.2")]))
                with pytest.raises(OSError, match="not permitted"):
                    await relay.sync(request)
                vip.fail = False
                await relay.sync(request)
                assert vip.setups == 2 and listening(relay, "10.96.79.2")
            finally:
                await relay.close()
    run(loop_name, body)
