"""Builders for the IPVS datapath's unit tests: the datapath over the fakes, on node "node"
(192.0.2.10), without kernel conntrack."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from usproxy.model.node import LocalAddresses, NodeFacts
from usproxy.model.types import IPAddress
from usproxy.offload.ipvs.datapath import IpvsDatapath
from usproxy.offload.ipvs.fake import FakeIpvsKernel, FakeIpvsTools
from usproxy.offload.kernel_conntrack import KernelConntrack, ListedUdp

NODE_IP = ipaddress.ip_address("192.0.2.10")
IP = ipaddress.ip_address


class NoConntrack(KernelConntrack):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[set[tuple[str, int]]] = []
        self.turned: list[set[tuple[tuple[str, int], str]]] = []
        self.listed: list[set[tuple[str, int]]] = []
        self.calls: list[str] = []  # every call's name, in order

    async def list_udp(self, orig_dst: Iterable[tuple[str, int]]) -> ListedUdp:
        self.calls.append("list_udp")
        self.listed.append(set(orig_dst))
        return ListedUdp()

    async def delete_listed(self, listed: ListedUdp) -> int:
        self.calls.append("delete_listed")
        return listed.delete()

    async def delete_udp(self, *, reply_src: object = (), orig_dst: object = ()) -> int:
        self.calls.append("delete_udp")
        self.deleted.append({*reply_src, *orig_dst})  # type: ignore[misc]
        return 0

    async def delete_udp_turned_answers(self, pairs: Iterable[tuple[tuple[str, int], str]]) -> int:
        self.calls.append("delete_udp_turned_answers")
        self.turned.append(set(pairs))
        return 0


def addresses(*more: tuple[str, IPAddress]) -> object:
    async def read() -> LocalAddresses:
        return [("eth0", NODE_IP), ("lo", IP("127.0.0.1")), ("usproxy0", IP("10.96.0.1")), *more]
    return read


def datapath(kernel: FakeIpvsKernel, tools: FakeIpvsTools | None = None, **kw: object) -> IpvsDatapath:
    return IpvsDatapath(kernel, tools or FakeIpvsTools(), NoConntrack(), node=NodeFacts("node"),  # type: ignore[arg-type]
                        addresses=addresses(), node_ips=lambda: (NODE_IP,), **kw)  # type: ignore[arg-type]
