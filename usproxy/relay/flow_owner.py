"""FlowOwner: what a relayed TCP connection or UDP flow asks of the ServicePort it belongs to.

The TCP and UDP relays (tcp.py, udp.py) know their ServicePort only through this interface, so
they import nothing of the ServicePortRelay that implements it (and tests drive them with a fake).
Every flow is admitted by `new_flow` before it is relayed and given back by `end_flow` exactly once;
every endpoint counted by `opened` is given back by `closed` exactly once (leastConnections counts
and flow accounting rely on both pairs).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from usproxy.flows.flow_table import Flow, HostPort
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import Scope, ServicePortName



class SourceRefused(Exception):
    """The client is outside the loadBalancerSourceRanges of the LB IP it came to: it never
    reaches an endpoint (TCP: reset without a dial; UDP: the datagram is dropped, no flow)."""


class RelayStopping(SourceRefused):
    """The relay is stopping (Relay.close, the agent's exit): a connection accepted before its
    listener closed but handed to its protocol only after the relayed flows were reset is refused
    as a SourceRefused one (TCP: reset without a dial), never relayed until the exit ends it
    with FIN."""


class FlowOwner(Protocol):
    """The ServicePort side of a flow: endpoint choice and flow admission."""

    @property
    def spn(self) -> ServicePortName:
        """The ServicePort, for logs."""
        ...

    def pick(self, kind: Scope, client_ip: str, exclude: Collection[Endpoint]) -> Endpoint | None:
        """The endpoint for a new connection or flow from `client_ip`, none of `exclude`; None when
        there is no usable one (the caller refuses the client)."""
        ...

    def failed(self, kind: Scope, ep: Endpoint) -> None:
        """`ep` refused or timed out a dial: back off from it."""
        ...

    def opened(self, kind: Scope, ep: Endpoint) -> None:
        """A connection or flow to `ep` started."""
        ...

    def closed(self, kind: Scope, ep: Endpoint) -> None:
        """A connection or flow to `ep` (counted by `opened`) ended."""
        ...

    def new_flow(self, protocol: str, client: HostPort, frontend: HostPort) -> Flow:
        """Admit a flow into the flow table; raises FlowTableFull when it may not start, and
        SourceRefused when the client may not reach `frontend` (loadBalancerSourceRanges)."""
        ...

    def end_flow(self, flow: Flow) -> None:
        """The flow ended: out of the flow table."""
        ...

    def reserve_pipes(self) -> bool:
        """Count a spliced TCP flow's two pipes (four descriptors) against the descriptor budget;
        False when they do not fit (the flow then stays on the event loop's path)."""
        ...

    def release_pipes(self) -> None:
        """Give back what one `reserve_pipes` that returned True counted."""
        ...
