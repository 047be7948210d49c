"""FakeKernelDatapath: a KernelDatapath that records what it holds, for the manager's unit tests.

`fail_next` refuses the next transactions, `fail_spns` refuses any transaction that contains one
of them (to test bisection and demotion), `unsupported_reasons` answers `unsupported()`, and
`available` answers `probe()`. `dump()` renders what is installed, one ServicePort a line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from usproxy.core.datapath import ServicePortState
from usproxy.model.endpoint import Endpoint
from usproxy.util.errors import OffloadError
from usproxy.offload.kernel_datapath import Capability, TrafficKind
from usproxy.model.types import ServicePortName, format_hostport
from usproxy.util.rows import FlowRow


class FakeKernelDatapath:
    """Holds ServicePortStates as a kernel datapath would; every apply is all or nothing."""

    def __init__(self, name: str = "nftables", traffic: frozenset[TrafficKind] = frozenset({"local", "forwarded"}),
                 *, available: bool = True,
                 unsupported_if: Callable[[ServicePortState], str | None] | None = None) -> None:
        self.name = name
        self.traffic = traffic
        self.available = available
        self.unsupported_if = unsupported_if
        self.installed: dict[ServicePortName, ServicePortState] = {}
        self.applies: list[dict[ServicePortName, ServicePortState | None]] = []
        self.cleared: list[dict[ServicePortName, frozenset[Endpoint]]] = []
        self.fail_next = 0
        self.fail_spns: set[ServicePortName] = set()
        self.cleaned = False
        self.closed = False

    def probe(self) -> Capability:
        return Capability(self.name, self.available, "fake" if self.available else "fake: switched off")

    def unsupported(self, state: ServicePortState) -> str | None:
        return self.unsupported_if(state) if self.unsupported_if else None

    async def apply(self, changes: Mapping[ServicePortName, ServicePortState | None]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise OffloadError("injected failure", 16)
        bad = self.fail_spns & {spn for spn, st in changes.items() if st is not None}
        if bad:
            raise OffloadError(f"refused {sorted(s.key() for s in bad)}", 22)
        self.applies.append(dict(changes))
        for spn, st in changes.items():
            if st is None:
                self.installed.pop(spn, None)
            else:
                self.installed[spn] = st

    async def read_back(self) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        return {spn: tuple(sorted({*st.cluster_endpoints, *st.external_endpoints}))
                for spn, st in self.installed.items()}

    async def clear_stale(self, removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> None:
        self.cleared.append(dict(removed))

    def flows_view(self) -> list[FlowRow]:
        """One made-up flow per installed ServicePort, from 192.0.2.1 to its ClusterIP, answered by
        its first endpoint (or none)."""
        out: list[FlowRow] = []
        for spn in sorted(self.installed):
            sp, eps = self.installed[spn].service_port, self.installed[spn].cluster_endpoints
            front, ep = format_hostport(sp.cluster_ip, sp.port), str(eps[0]) if eps else "-"
            out.append({"protocol": spn.protocol, "state": "ESTABLISHED", "age": None, "idle": None,
                        "original": {"src": "192.0.2.1:40000", "dst": front},
                        "reply": {"src": ep, "dst": "192.0.2.1:40000"}, "packets_in": 0, "bytes_in": 0,
                        "packets_out": 0, "bytes_out": 0, "datapath": self.name, "service": spn.key()})
        return out

    def dump(self) -> str:
        lines = []
        for spn in sorted(self.installed):
            st = self.installed[spn]
            front = format_hostport(st.service_port.cluster_ip, st.service_port.port)
            eps = " ".join(str(ep) for ep in st.cluster_endpoints) or "reject"
            lines.append(f"{spn.key()} {front} -> {eps}")
        return "\n".join(lines)

    async def cleanup(self) -> None:
        self.installed.clear()
        self.cleaned = True

    def close(self) -> None:
        self.closed = True
