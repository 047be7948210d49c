"""Reflector and ApiListWatch against the fake API server: the list/watch protocol and every fault.

Each fault test arms one fault, makes the server's state change across it, and checks that the
store converges to the server's objects, and, where it matters, how: resumed from the last
resourceVersion (no relist) or relisted (after 410), with backoff rather than a hot loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.sources.conftest import FAST, eventually, svc
from tests.sources.fake_apiserver import FakeApiServer
from usproxy.sources.api_list_watch import SERVICES, ApiListWatch, excerpt
from usproxy.sources.kube import client_config
from usproxy.sources.reflector import Backoff, Reflector, ReflectorOptions


class RawStore:
    """Keeps raw objects by namespace/name, counting how it was told."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.replaces = 0
        self.deletes = 0
        self.fail_next = 0

    @staticmethod
    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])

    async def replace(self, items: list[dict[str, Any]]) -> None:
        self.replaces += 1
        self.objects = {self.key(o): o for o in items}

    def upsert(self, obj: dict[str, Any]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected store bug")
        self.objects[self.key(obj)] = obj

    def delete(self, obj: dict[str, Any]) -> None:
        self.deletes += 1
        self.objects.pop(self.key(obj), None)


def same(api: FakeApiServer, store: RawStore) -> bool:
    """The store holds exactly the server's Services, at the server's resourceVersions."""
    want = {k: o["metadata"]["resourceVersion"] for k, o in api.objects["services"].items()}
    return want == {k: o["metadata"]["resourceVersion"] for k, o in store.objects.items()}


@pytest.fixture
async def client(kubeconfig: Path) -> AsyncIterator[Any]:
    from kubernetes_asyncio.client import ApiClient

    async with ApiClient(await client_config(kubeconfig)()) as c:
        yield c


class Running:
    """A Reflector on Services running as a task for the duration of a test."""

    def __init__(self, client: Any, options: ReflectorOptions = FAST) -> None:
        self.store = RawStore()
        self.reflector = Reflector("Services", ApiListWatch(client, SERVICES, options=options), self.store, options)
        self.task = asyncio.create_task(self.reflector.run())

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def running(client: Any) -> AsyncIterator[Running]:
    r = Running(client)
    try:
        yield r
    finally:
        await r.stop()


def watches(api: FakeApiServer) -> list[dict[str, str]]:
    return [q for res, q in api.requests if res == "services" and q.get("watch") == "true"]


def lists(api: FakeApiServer) -> list[dict[str, str]]:
    return [q for res, q in api.requests if res == "services" and q.get("watch") != "true"]


# -- the protocol ------------------------------------------------------------------------------

async def test_lists_then_watches_from_the_lists_resource_version(api: FakeApiServer, running: Running) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    await running.reflector.synced.wait()
    listed_rv = running.reflector.resource_version
    api.apply("services", svc("b", "10.96.0.2"))
    api.delete("services", "a")
    await eventually(lambda: same(api, running.store), what="watch events applied")
    first = watches(api)[0]
    assert first["resourceVersion"] == listed_rv
    assert first["allowWatchBookmarks"] == "true"
    assert 1 <= int(first["timeoutSeconds"]) <= 2  # randomised in [min, 2 × min)
    assert lists(api)[0]["resourceVersion"] == "0"  # first list may come from the watch cache
    assert running.store.replaces == 1 and running.store.deletes == 1


async def test_bookmarks_move_the_resource_version(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    api.apply("endpointslices", {"metadata": {"name": "other", "labels": {}}})  # rv moves elsewhere
    await eventually(lambda: running.reflector.resource_version == str(api.rv), what="a BOOKMARK")
    assert running.store.objects == {}


async def test_watch_timeout_resumes_without_relisting(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    await eventually(lambda: len(watches(api)) >= 2, timeout=4, what="a second watch after the timeout")
    api.apply("services", svc("late", "10.96.0.9"))
    await eventually(lambda: same(api, running.store))
    assert len(lists(api)) == 1
    assert watches(api)[1]["resourceVersion"] != "0"


async def test_paged_list_reads_every_page_at_one_resource_version(api: FakeApiServer, client: Any) -> None:
    for i in range(7):
        api.apply("services", svc(f"s{i}", f"10.96.0.{i + 1}"))
    lw = ApiListWatch(client, SERVICES, options=ReflectorOptions(page_size=3))
    result = await lw.list("")
    assert [o["metadata"]["name"] for o in result.items] == [f"s{i}" for i in range(7)]
    assert result.resource_version == str(api.rv)
    pages = lists(api)
    assert [q.get("limit") for q in pages] == ["3", "3", "3"]
    assert "continue" in pages[1] and "resourceVersion" not in pages[1]


async def test_expired_continue_token_relists_with_a_consistent_read(api: FakeApiServer, client: Any) -> None:
    for i in range(5):
        api.apply("services", svc(f"s{i}", f"10.96.0.{i + 1}"))
    r = Running(client, dataclasses.replace(FAST, page_size=2))
    try:
        await r.reflector.synced.wait()  # resourceVersion "0": served whole from the cache, no paging
        last = r.reflector.resource_version
        api.faults.expire_continue = 1
        api.replace_all("services", [svc(f"t{i}", f"10.96.1.{i + 1}") for i in range(5)])
        api.end_streams()  # watch → 410 → paged relist → its token expires → 410 → relist
        await eventually(lambda: same(api, r.store), what="list after the expired token")
        first_pages = [q.get("resourceVersion", "") for q in lists(api) if "continue" not in q]
        assert first_pages == ["0", last, ""]  # client-go: after a 410 list, read from etcd, not the cache
        assert api.faults.expire_continue == 0
    finally:
        await r.stop()


async def test_selectors_are_sent_and_honoured(api: FakeApiServer, client: Any) -> None:
    api.apply("services", svc("plain", "10.96.0.1"))
    api.apply("services", svc("hidden", "10.96.0.2", labels={"service.kubernetes.io/headless": ""}))
    lw = ApiListWatch(client, SERVICES, label_selector="!service.kubernetes.io/headless", options=FAST)
    result = await lw.list("")
    assert [o["metadata"]["name"] for o in result.items] == ["plain"]
    assert lists(api)[0]["labelSelector"] == "!service.kubernetes.io/headless"


def test_backoff_doubles_from_0_8_to_30_seconds_and_resets() -> None:
    b = Backoff(0.8, 30.0, jitter=0.0)
    delays = [b.next() for _ in range(8)]
    assert delays == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    b.reset()
    assert b.next() == 0.8
    jittered = Backoff(0.8, 30.0, jitter=0.2).next()
    assert 0.8 <= jittered <= 0.96


def test_defaults_follow_client_go() -> None:
    opts = ReflectorOptions()
    assert (opts.min_watch_timeout, opts.backoff_initial, opts.backoff_max) == (300.0, 0.8, 30.0)


def test_excerpt_strips_html() -> None:
    page = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"
    assert excerpt(page, "text/html") == "502 Bad Gateway 502 Bad Gateway"


# -- faults ------------------------------------------------------------------------------------

async def test_410_inside_a_200_stream_relists_and_delivers_deletes(api: FakeApiServer, running: Running) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("services", svc("b", "10.96.0.2"))
    await eventually(lambda: same(api, running.store))
    # The state changes with no events and the history is compacted: only a relist can tell.
    api.replace_all("services", [svc("b", "10.96.0.2"), svc("c", "10.96.0.3")])
    api.end_streams()  # the next watch, from a compacted resourceVersion, gets ERROR 410 in a 200
    await eventually(lambda: same(api, running.store), timeout=3, what="relist after 410")
    assert ("default", "a") not in running.store.objects
    assert running.store.replaces >= 2


async def test_410_error_event_from_the_fault_switch(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    api.faults.gone_in_stream = 1
    api.end_streams()
    before = running.store.replaces
    await eventually(lambda: running.store.replaces > before, what="a relist after ERROR 410")
    api.apply("services", svc("x", "10.96.0.7"))
    await eventually(lambda: same(api, running.store))


async def test_http_410_on_watch_relists(api: FakeApiServer, running: Running) -> None:
    api.apply("services", svc("old", "10.96.0.4"))
    await eventually(lambda: same(api, running.store))
    listed, replaced = len(lists(api)), running.store.replaces
    api.faults.gone_status = 1
    # "old" vanishes with no event and the history is compacted: only a relist can tell
    api.replace_all("services", [svc("n", "10.96.0.5")])
    api.end_streams()  # the next watch gets HTTP 410
    await eventually(lambda: same(api, running.store), what="relist after HTTP 410")
    assert api.faults.gone_status == 0 and ("default", "old") not in running.store.objects
    assert len(lists(api)) == listed + 1 and running.store.replaces == replaced + 1


async def test_repeated_410_backs_off_instead_of_hot_looping(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    api.faults.gone_in_stream = 1000
    await asyncio.sleep(0.6)
    n = len(lists(api))
    assert 3 <= n <= 15, n  # relists, but paced by the backoff (0.05 s doubling to 0.2 s)
    api.faults.gone_in_stream = 0
    api.apply("services", svc("ok", "10.96.0.8"))
    await eventually(lambda: same(api, running.store))


async def test_stream_cut_mid_event_resumes_from_last_resource_version(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    api.faults.cut_event = 1
    api.apply("services", svc("a", "10.96.0.1"))  # its line is cut in half
    api.apply("services", svc("b", "10.96.0.2"))
    await eventually(lambda: same(api, running.store), what="events after the cut")
    assert api.faults.cut_event == 0 and len(lists(api)) == 1  # cut, then resumed without relist
    resumed = watches(api)[-1]
    assert int(resumed["resourceVersion"]) < int(api.objects["services"][("default", "a")]["metadata"]["resourceVersion"])


async def test_silent_stream_hits_the_read_timeout_and_resumes(api: FakeApiServer, client: Any) -> None:
    opts = ReflectorOptions(min_watch_timeout=30, read_timeout=0.3, list_timeout=1, backoff_initial=0.05,
                            backoff_max=0.2, backoff_jitter=0, short_watch=0.05)
    api.faults.stall = 1
    r = Running(client, opts)
    try:
        await r.reflector.synced.wait()
        await eventually(lambda: watches(api), what="the stalled watch")
        api.apply("services", svc("a", "10.96.0.1"))  # swallowed by the stalled stream
        await eventually(lambda: same(api, r.store), timeout=2, what="resume after read timeout")
        assert len(watches(api)) == 2 and len(lists(api)) == 1
    finally:
        await r.stop()


async def test_slow_responses_time_out_then_succeed(api: FakeApiServer, client: Any) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    api.faults.delay = 1.0  # longer than list_timeout (0.5 s)
    r = Running(client)
    try:
        await asyncio.sleep(0.8)
        assert not r.reflector.synced.is_set()
        api.faults.delay = 0.1  # slow but within the timeouts
        await eventually(lambda: same(api, r.store), timeout=3, what="list after the server sped up")
        api.apply("services", svc("b", "10.96.0.2"))
        await eventually(lambda: same(api, r.store), what="watch while slow")
    finally:
        await r.stop()


@pytest.mark.parametrize("fault", ["html_error", "html_ok", "status_error"])
async def test_error_pages_back_off_and_recover(api: FakeApiServer, client: Any, fault: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    setattr(api.faults, fault, 3)
    with caplog.at_level(logging.WARNING, "usproxy.sources.reflector"):
        r = Running(client)
        try:
            await eventually(lambda: same(api, r.store), what=f"recovery from {fault}")
        finally:
            await r.stop()
    assert getattr(api.faults, fault) == 0
    text = caplog.text
    assert {"html_error": "HTTP 502 Bad Gateway: 502 Bad Gateway", "html_ok": "expected JSON, got text/html",
            "status_error": "etcdserver: request timed out"}[fault] in text
    assert "<html>" not in text


async def test_stream_ending_at_once_is_a_very_short_watch(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    api.faults.end_at_once = 3
    api.apply("services", svc("a", "10.96.0.1"))
    await eventually(lambda: same(api, running.store))
    assert len(lists(api)) == 1


async def test_server_restart_keeps_state_then_converges(api: FakeApiServer, running: Running) -> None:
    api.apply("services", svc("a", "10.96.0.1"))
    api.apply("services", svc("b", "10.96.0.2"))
    await eventually(lambda: same(api, running.store))
    await api.stop()
    await asyncio.sleep(0.5)  # several backoff rounds against a closed port
    assert set(running.store.objects) == {("default", "a"), ("default", "b")}
    assert running.store.deletes == 0
    api.delete("services", "a")  # changed while down, history lost in the restart
    api.apply("services", svc("c", "10.96.0.3"))
    await api.restart()
    await eventually(lambda: same(api, running.store), what="converge after restart")
    assert len(lists(api)) == 2  # the old resourceVersion was compacted away: one relist


async def test_server_restart_with_history_resumes_the_watch(api: FakeApiServer, running: Running) -> None:
    await running.reflector.synced.wait()
    await api.stop()
    api.apply("services", svc("a", "10.96.0.1"))
    await api.start()
    await eventually(lambda: same(api, running.store))
    assert len(lists(api)) == 1  # the old resourceVersion was still valid: no relist


async def test_a_store_bug_is_logged_and_the_reflector_carries_on(api: FakeApiServer, running: Running,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    await running.reflector.synced.wait()
    running.store.fail_next = 1
    api.apply("services", svc("a", "10.96.0.1"))
    await eventually(lambda: same(api, running.store), what="recovery by relist")
    assert "unexpected error" in caplog.text and len(lists(api)) == 2


async def test_a_reader_makes_each_item_as_it_is_decoded_in_a_worker_thread(api: FakeApiServer,
                                                                              client: Any) -> None:
    """ApiListWatch's `read` (kube.ObjectCache.read): the list holds what it made of each item,
    in order, never the raw objects; it ran off the loop's thread."""
    import threading

    for i in range(7):
        api.apply("services", svc(f"s{i}", f"10.96.0.{i + 1}"))
    threads: set[int] = set()

    def read(raw: dict[str, Any]) -> tuple[str, str]:
        threads.add(threading.get_ident())
        return ("read", raw["metadata"]["name"])

    lw = ApiListWatch(client, SERVICES, options=ReflectorOptions(page_size=3), read=read)
    result = await lw.list("")
    assert result.items == [("read", f"s{i}") for i in range(7)]
    assert threads and threading.get_ident() not in threads


def test_a_readers_own_value_error_is_not_taken_for_bad_json() -> None:
    """decode_list reports JSON that does not decode as a SourceError ("expected JSON"); a
    ValueError the reader raises is the reader's (a bug), and says so."""
    from usproxy.sources.api_list_watch import decode_list
    from usproxy.util.errors import SourceError

    def read(raw: dict[str, Any]) -> object:
        raise ValueError("a bug in a parse")

    body = b'{"kind": "ServiceList", "metadata": {}, "items": [{"metadata": {"name": "a"}}]}'
    with pytest.raises(RuntimeError, match="reading a listed item: ValueError"):
        decode_list(body, "application/json", read)
    with pytest.raises(SourceError, match="expected JSON"):
        decode_list(body[:-3], "application/json", read)
