"""A node daemon owns a Service port, unit level: the real ServicePortRelay on 127.0.0.1 (no
namespace needed) whose port is held by a wildcard listener this test opens.

Before: every retry of the held listener logged "listen failed" again (27 lines in 25 s) and
/services said only "Address already in use". Now the cause names the holder (here this very
process: "this agent"), is logged once however often it is retried, and the relay takes the port
as soon as it is free, saying so once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket

import pytest

from usproxy.flows.flow_table import FlowTable
from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.relay.flow_admission import FlowAdmission
from usproxy.relay.service_port_relay import ListenerKey, ServicePortRelay
from usproxy.relay.udp import UdpRelay
from usproxy.model.service_port import ServicePort
from usproxy.model.types import ServicePortName


def wildcard_listener() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # makes no difference against a listener
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s


def state(port: int) -> ServicePortState:
    spn = ServicePortName("default", "sshlike", "ssh", "TCP")
    sp = ServicePort(spn, (ipaddress.ip_address("127.0.0.1"),), port, 2222)
    eps = (Endpoint(ipaddress.ip_address("10.244.1.5"), 2222),)
    return ServicePortState(sp, eps, eps, eps)


async def test_held_port_is_named_logged_once_and_taken_when_free(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="usproxy.relay.service_port_relay")
    daemon = wildcard_listener()
    port = int(daemon.getsockname()[1])
    udp = UdpRelay(30.0)
    relay = ServicePortRelay(state(port), admission=FlowAdmission(FlowTable(100), 100, udp.evict_oldest),
                             udp=udp, listening=set(), default_policy="roundRobin")
    try:
        await relay.apply(state(port), ())
        for _ in range(5):
            await relay.retry_failed()
        key: ListenerKey = ("127.0.0.1", port, "cluster")
        assert not relay.listeners
        assert relay.errors[key] == (f"listen 127.0.0.1:{port}: Address already in use "
                                     f"(held by 0.0.0.0:{port} of this agent (pid {os.getpid()}); "
                                     "its traffic goes there)")
        failed = [r for r in caplog.records if "Address already in use" in r.getMessage()]
        assert len(failed) == 1
        daemon.close()
        await relay.retry_failed()
        assert key in relay.listeners and not relay.errors
        taken = [r for r in caplog.records if "after all" in r.getMessage()]
        assert [r.getMessage() for r in taken] == [f"default/sshlike:ssh: listening on 127.0.0.1:{port}/TCP after all"]
    finally:
        daemon.close()
        await relay.close()
        await asyncio.sleep(0)


async def test_held_port_error_is_dropped_with_its_frontend() -> None:
    daemon = wildcard_listener()
    port = int(daemon.getsockname()[1])
    udp = UdpRelay(30.0)
    relay = ServicePortRelay(state(port), admission=FlowAdmission(FlowTable(100), 100, udp.evict_oldest),
                             udp=udp, listening=set(), default_policy="roundRobin")
    try:
        await relay.apply(state(port), ())
        assert relay.errors
        none = ServicePortState(state(port).service_port, (), (), ())
        await relay.apply(none, ())  # no endpoints: the frontend is no longer wanted
        assert not relay.errors
        daemon.close()
        await relay.retry_failed()
        assert not relay.listeners  # not opened behind the back of a ServicePort without endpoints
    finally:
        daemon.close()
        await relay.close()
