"""The pinned maps as the datapath writes them: cost per change, rollback, Maglev, dual stack,
probing. Root and a test cgroup, but no traffic."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from tests.offload.bpf.builders import ep, spn, state
from tests.offload.bpf.conftest import Env
from usproxy.util.errors import OffloadError
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.core.datapath import ServicePortState
from usproxy.offload.bpf.layout import MAGLEV_M, SRC_RANGE_KEY_SIZE, unpack_src_range

pytestmark = pytest.mark.netns


def _many(n: int) -> dict:  # type: ignore[type-arg]
    out = {}
    for i in range(n):
        name = spn(f"svc{i}")
        out[name] = state(name, f"10.96.{i // 250}.{i % 250 + 1}", 80,
                          [ep(f"10.244.{i // 250}.{i % 250 + 1}"), ep(f"10.244.{i // 250 + 10}.{i % 250 + 1}")])
    return out


async def test_writes_are_proportional_to_the_change(bpf_env: Env) -> None:
    dp = bpf_env.dp
    services = _many(500)
    await dp.apply(services)
    assert dp.last_writes == 500 * (1 + 2 + 2 + 1)  # name, 2 backends, 2 slots, 1 frontend

    one = spn("svc7")
    grown = state(one, "10.96.0.8", 80, [*services[one].cluster_endpoints, ep("10.244.99.8")])
    await dp.apply({one: grown})
    assert dp.last_writes == 3  # backend, slot 3, count

    big = spn("big")
    eps = [ep(f"10.244.{100 + i // 250}.{i % 250 + 1}") for i in range(1000)]
    await dp.apply({big: state(big, "10.96.200.1", 80, eps)})
    await dp.apply({big: state(big, "10.96.200.1", 80, eps[:500] + eps[501:])})
    assert dp.last_writes <= 4  # last slot moves into the hole, count, tail slot, backend
    await dp.apply({big: None})
    await dp.apply({big: None})
    assert dp.last_writes == 0


async def test_failed_apply_changes_nothing(bpf_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    dp = bpf_env.dp
    await dp.apply(_many(20))
    before = dp.dump()
    real, calls = bpf.map_update, []

    def failing(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
        calls.append(1)
        if len(calls) == 30:
            raise bpf.BpfError("injected", 28)
        real(fd, key, value, flags)

    monkeypatch.setattr(bpf, "map_update", failing)
    changed = {spn(f"svc{i}"): None for i in range(10)} | _many(40)
    with pytest.raises(OffloadError):
        await dp.apply(changed)
    monkeypatch.setattr(bpf, "map_update", real)

    assert dp.dump() == before
    fresh = BpfDatapath(bpf_env.cgroup, bpf_env.pin_root)
    try:
        assert await fresh.read_back() == await dp.read_back()
        assert fresh.dump() == before
    finally:
        fresh.close()


async def test_maglev_tables_move_few_positions(bpf_env: Env) -> None:
    bpf_env.dp.close()
    dp = bpf_env.dp = BpfDatapath(bpf_env.cgroup, bpf_env.pin_root, selection="maglev")
    name = spn("mg")
    eps = [ep(f"10.244.{i}.40") for i in range(1, 11)]
    await dp.apply({name: state(name, "10.96.40.40", 80, eps)})
    assert dp.last_writes == MAGLEV_M + 1 + 10 + 10 + 1 + 1  # table, outer, backends, slots, name, frontend

    await dp.apply({name: state(name, "10.96.40.40", 80, eps[1:])})
    assert dp.last_writes < MAGLEV_M // 10 + MAGLEV_M // 50  # about the removed one's share
    assert "select=maglev" in dp.dump() and "maglev table 16381 entries" in dp.dump()

    again = BpfDatapath(bpf_env.cgroup, bpf_env.pin_root, selection="maglev")
    try:
        await again.apply({name: state(name, "10.96.40.40", 80, eps[1:])})
        assert again.last_writes == 0  # the table read back equals the one computed
    finally:
        again.close()


async def test_dual_stack_is_two_groups_read_back_as_one(bpf_env: Env) -> None:
    name = spn("ds")
    st = state(name, ("10.96.50.50", "2001:db8:96::50"), 80, [ep("10.244.1.50"), ep("2001:db8:244:1::50")])
    await bpf_env.dp.apply({name: st})
    assert await bpf_env.dp.read_back() == {name: tuple(sorted(st.cluster_endpoints))}
    dump = bpf_env.dp.dump()
    assert "frontend 10.96.50.50:80/TCP" in dump and "frontend [2001:db8:96::50]:80/TCP" in dump


def test_probe(bpf_env: Env, tmp_path: Path) -> None:
    cap = bpf_env.dp.probe()
    assert cap.available, cap.detail
    missing = BpfDatapath(bpf_env.cgroup / "no-such-cgroup", bpf_env.pin_root).probe()
    assert not missing.available and "cgroup v2" in missing.detail
    # a directory that is not on cgroup v2 (a v1 controller's directory is refused the same way,
    # but which of those a machine has is not this test's to know)
    not_v2 = BpfDatapath(tmp_path, bpf_env.pin_root).probe()
    assert not not_v2.available and "cgroup v2" in not_v2.detail


def _sources(dp: BpfDatapath) -> set[str]:
    assert dp._tables is not None
    keys = bpf.map_keys(dp._tables.fds["usp_tc_sources"], SRC_RANGE_KEY_SIZE)
    return {str(unpack_src_range(k)[1]) for k in keys}


async def test_source_ranges_are_written_exactly_and_follow_the_service(bpf_env: Env) -> None:
    dp = bpf_env.dp
    dp.traffic = frozenset({"local", "forwarded"})  # the tc groups, without attaching tc anywhere
    name = spn("lb")

    def lb(*ranges: str) -> ServicePortState:
        return state(name, "10.96.0.10", 80, [ep("10.244.1.5")], service_type="LoadBalancer",
                     load_balancer_ips=(ipaddress.IPv4Address("198.51.100.1"),),
                     source_ranges=tuple(ipaddress.ip_network(r) for r in ranges))

    await dp.apply({name: lb("203.0.113.0/25", "203.0.113.0/24")})  # nested: an LPM lookup would see one
    assert _sources(dp) == {"203.0.113.0/24", "203.0.113.0/25"}
    await dp.apply({name: lb("203.0.113.0/24")})
    assert _sources(dp) == {"203.0.113.0/24"}
    await dp.apply({name: lb()})
    assert _sources(dp) == set() and "source-ranges" not in dp.dump()
    await dp.apply({name: lb("10.0.0.0/8")})
    assert "tc=source-ranges" in dp.dump()
    await dp.apply({name: None})
    assert _sources(dp) == set()
