"""The BPF datapath's count of what it sent to the kernel (KernelWriteCounter, read by `usproxy
tour` through usproxy_kernel_writes_total): every map element written or deleted by an apply
that succeeded, none for one rolled back; an endpoint change costs the same among 5 Services or
300. Root and a test cgroup, no traffic."""

from __future__ import annotations

import pytest

from tests.offload.bpf.builders import ep, spn, state
from tests.offload.bpf.conftest import Env
from usproxy.offload.bpf import libbpf as bpf
from usproxy.util.errors import OffloadError

pytestmark = pytest.mark.netns


def services(n: int) -> dict:  # type: ignore[type-arg]
    out = {}
    for i in range(n):
        name = spn(f"svc{i}")
        out[name] = state(name, f"10.96.{i // 250}.{i % 250 + 1}", 80,
                          [ep(f"10.244.{i // 250}.{i % 250 + 1}"), ep(f"10.244.{i // 250 + 10}.{i % 250 + 1}")])
    return out


class MapWrites:
    """Every bpf_map_update_elem and bpf_map_delete_elem made while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        update, delete = bpf.map_update, bpf.map_delete

        def counted_update(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
            self.count += 1
            update(fd, key, value, flags)

        def counted_delete(fd: int, key: bytes) -> bool:
            self.count += 1
            return delete(fd, key)

        monkeypatch.setattr(bpf, "map_update", counted_update)
        monkeypatch.setattr(bpf, "map_delete", counted_delete)


@pytest.mark.parametrize("n", [5, 300])
async def test_the_count_is_the_map_writes_and_an_endpoint_change_costs_the_same_at_any_size(
        bpf_env: Env, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    dp = bpf_env.dp
    svcs = services(n)
    await dp.apply(svcs)
    writes = MapWrites(monkeypatch)
    before = dp.kernel_writes()
    one = spn("svc3")
    await dp.apply({one: state(one, "10.96.0.4", 80, [svcs[one].cluster_endpoints[0], ep("10.244.99.4")])})
    assert dp.kernel_writes() - before == writes.count == 3  # the same 3 elements among 5 Services or 300


async def test_a_rolled_back_apply_counts_nothing(bpf_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    dp = bpf_env.dp
    await dp.apply(services(5))
    before, real, calls = dp.kernel_writes(), bpf.map_update, []

    def failing(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise bpf.BpfError("map full", 28)
        real(fd, key, value, flags)

    monkeypatch.setattr(bpf, "map_update", failing)
    with pytest.raises((OffloadError, bpf.BpfError)):
        await dp.apply(services(20))
    assert dp.kernel_writes() == before
