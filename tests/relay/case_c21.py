"""Field case C21's Services and load: `multi` (two ports, NodePorts, a backend whose readiness
flips) and `steady` beside it, and a client thread making 100 connections/s that records every
outcome; shared by the relay test (test_c21_reconcile) and the offload run of the field cases
(tests/offload/test_field_cases_offload)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.netns import inside
from tests.relay.harness import slice_, svc
from tests.relay.tcp_clients import attempt

MULTI, STEADY = "10.96.160.160", "10.96.160.161"


BE = {"be-a": "10.244.1.60", "be-b": "10.244.2.60"}


BE_S = "10.244.3.60"


NODE = "192.0.2.10"


Record = tuple[float, str, str]  # (start, outcome kind, backend name)


def multi(http_target: int = 8080, https: bool = True, b_ready: bool = True) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": 80, "targetPort": http_target, "nodePort": 30080}]
    slice_ports = [{"name": "http", "port": http_target, "protocol": "TCP"}]
    if https:
        ports.append({"name": "https", "port": 443, "targetPort": 8443, "nodePort": 30443})
        slice_ports.append({"name": "https", "port": 8443, "protocol": "TCP"})
    eps = [{"ip": BE["be-a"], "ready": True}, {"ip": BE["be-b"], "ready": b_ready}]
    return [svc("multi", MULTI, ports, type="NodePort"), slice_("multi", eps, slice_ports)]


def steady() -> list[dict[str, Any]]:
    return [svc("steady", STEADY, [{"port": 80, "targetPort": 8080}]),
            slice_("steady", [{"ip": BE_S, "ready": True}], [{"port": 8080, "protocol": "TCP"}])]


class Load:
    """A client thread making 100 connections/s to addr:port, recording every outcome."""

    def __init__(self, ns: str, addr: str, port: int) -> None:
        self.ns, self.addr, self.port = ns, addr, port
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with inside(self.ns):
            slot = time.monotonic()
            while not self._stop.is_set():
                o = attempt(self.addr, self.port)
                self.records.append((slot, o.kind, o.name))
                slot = max(slot + 0.01, time.monotonic() - 0.01)
                time.sleep(max(0.0, slot - time.monotonic()))

    def between(self, t0: float, t1: float = float("inf")) -> list[Record]:
        return [r for r in list(self.records) if t0 <= r[0] < t1]

    @contextmanager
    def running(self) -> Iterator[Load]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def failures(records: list[Record]) -> list[Record]:
    return [r for r in records if r[1] != "ok"]


def wait_past(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))
