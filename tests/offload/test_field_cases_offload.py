"""Field cases C05, C11, C21 and C22 through the real agent with nftables offload.

The userspace versions are in tests/relay (test_c05*, test_c11*, test_c21*, test_c22*); here the
same servers and clients run against `usproxy run --offload nftables` (the flags of
test_agent_offload.py: offload after a 1 s window, syncs at most every 200 ms). Every test first
waits until its ServicePorts are placed on nftables, then sends real traffic, and checks that the
relay carried none of it: the agent's `usproxy_flows_total{protocol}` stays flat and, where the
backend logs its peers, every peer is the client's own address (the kernel DNATs; the relay would
dial from the node). NodePorts are reached from a client netns (10.244.9.10), not from the node.

- C05: one datagram of each of the 14 sizes 0..65,507, 3 times each, through a ClusterIP to a pure
  UDP echo: every echo equal in length and sha256, one datagram per datagram (nothing left over,
  no MSG_TRUNC), the empty datagram included; /flows shows the kernel flow with 42/42 packets.
  No reduction.
- C11: blob downloads (8-byte length L, L seeded pseudo-random bytes, close at once; the client
  reads nothing for its first 100 ms) and uploads (L bytes, SHUT_WR, sha256 + count back) for
  L in {0, 1, 65535, 65536, 65537, 1 MiB+1, 16 MiB}, 20 repeats per size and direction (280
  transfers), 16 streams at once: every transfer has length L and a matching sha256, so EOF came
  after the last byte (uploads: the reply, then EOF). The relay test's numbers, no reduction; its
  RSS check has no meaning here (the relay carries none of it, which is checked instead).
- C21: `multi` (NodePort http 80->8080/30080, https 443->8443/30443; pods listening on 8080, 8443
  and 9090) and `steady` (80->8080), a client making up to 100 connections/s to each of steady:80
  and multi:80 throughout (sequential connects paced to 10 ms slots, ~90/s here). (1) targetPort
  8080 -> 9090: 1 s after the update every new connection lands on :9090 and the :8080 backends
  log no connection; (2) https removed: :443 and :30443 refused (ECONNREFUSED, not a hang) within
  1 s, its elements gone from the table, :80 without failure; (3) be-b's ready condition flipped
  201 times in 10 s (every 50 ms), ending not ready, then made ready again: within 1 s of each
  final update the slot maps and /services match it, and be-b logs no connection once it has been
  not ready for 1 s; (4) `multi` deleted: :80, :443, :30080 and :30443 refused within 1 s and no
  element of it (comment, ClusterIP or NodePort key, its pods' hairpin pairs) left in
  `table ip usproxy`; (5) re-created within 100 ms of the delete taking effect: works again within
  1 s (the relay serves it during its new offload window) and is back on nftables after it; (5b)
  deleted and re-created 50 ms apart (the case's "re-create within 100 ms" read literally; the
  manifest is polled every 200 ms, so the agent may never see the gap): works within 1 s; (6) 500
  unrelated Services created over 10 s (5 every 100 ms), each deleted 1.8 s after its creation, so
  that many are offloaded (the element count is seen above baseline; Services living < 1 s would
  never reach the kernel and prove nothing), then the count of set and map elements returns to the
  baseline within 2 s and their ClusterIPs refuse. Expectations: `steady` 0 failures throughout
  and every peer its backend saw is the client (never relayed); multi:80 0 failures except from
  a delete to 1 s after its re-create; the relay's TCP flow count flat over steps (1)-(3). The
  case's numbers (100 connections/s, 200 flips in 10 s, 500 Services in 10 s), no reduction; the
  relay test's CPU and RSS checks of the flip storm are the relay's, not repeated here.
- C22: kube-system/dns NodePort UDP 53->5353 and TCP 53->5354 sharing nodePort 30053, echo-tcp and
  echo-udp on port 7, with traps on the other protocol's target ports: 100 TCP and 100 UDP to
  10.96.0.10:53 and to 192.0.2.10:30053 all answered by the right protocol's target port, echo
  services never cross (the other protocol is refused); then only the TCP port of dns is removed
  while a UDP client per frontend keeps asking: UDP stays at 100 % (during and after), TCP to both
  frontends refused within 1 s. No reduction.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.agent import metric, placement, wait_for
from tests.relay.case_c05 import SIZES as C05_SIZES
from tests.relay.case_c05 import recv_whole
from tests.relay.case_c11 import BE as C11_BE
from tests.relay.case_c11 import BLOB, UPLOAD, download, upload
from tests.relay.case_c11 import SIZES as C11_SIZES
from tests.relay.case_c11 import objects as c11_objects
from tests.relay.case_c21 import BE as C21_BE
from tests.relay.case_c21 import BE_S, MULTI, STEADY, Load, Record, failures, multi, steady, wait_past
from tests.relay.case_c22 import BE_A, BE_X, BE_Y, DNS, ECHO_TCP, ECHO_UDP, tcp_echo
from tests.relay.case_c22 import objects as c22_objects
from tests.relay.harness import AgentProc, Backends, Manifests, slice_, svc
from tests.relay.tcp_clients import attempt, idsrv_log_after, run_async, start_server, wait_until
from tests.relay.tcp_servers import pattern_digest
from tests.relay.udp_helpers import ask, client_socket, icmp_unlimited, read_backend_log, start_udpsrv

pytestmark = pytest.mark.netns


CLIENT = "10.244.9.10"
NODE = "192.0.2.10"
Front = tuple[str, int]


@pytest.fixture
def backends(topology: Topology) -> Iterator[Backends]:
    b = Backends(topology)
    try:
        yield b
    finally:
        b.close()


# -- the node's nftables table ---------------------------------------------------------------------
Element = tuple[str, str, str, str]  # (set or map, key, value, comment)


def _text(v: Any) -> str:
    if isinstance(v, dict):
        if "concat" in v:
            return " . ".join(_text(x) for x in v["concat"])
        if "elem" in v:
            return _text(v["elem"]["val"])
        for verdict in ("goto", "jump"):
            if verdict in v:
                return f"{verdict} {v[verdict]['target']}"
        return json.dumps(v, sort_keys=True)
    return str(v)


def table_elements(node: str) -> list[Element]:
    """Every set and map element of `table ip usproxy` in the node netns."""
    out = nsexec(node, "nft", "-j", "list", "table", "ip", "usproxy").stdout
    rows: list[Element] = []
    for item in json.loads(out)["nftables"]:
        obj = item.get("map") or item.get("set")
        if obj is None:
            continue
        for e in obj.get("elem", []):
            key, value = (e[0], e[1]) if isinstance(e, list) else (e, None)
            comment = key["elem"].get("comment", "") if isinstance(key, dict) and "elem" in key else ""
            rows.append((obj["name"], _text(key), "" if value is None else _text(value), comment))
    return rows


def targets_of(elements: list[Element], key: str) -> set[str]:
    """The endpoints the slot maps hold for one frontend key ("10.96.x.y . tcp . 80", "tcp . 30080")."""
    return {v for name, k, v, _ in elements if "slot-" in name and k == key}


def relayed(agent: AgentProc) -> dict[str, float]:
    """The relay's flow counts (flows it created since start) per protocol."""
    return {p: metric(agent, "usproxy_flows_total", f'protocol="{p}"') for p in ("TCP", "UDP")}


def wait_offloaded(agent: AgentProc, *names: str, timeout: float = 10.0) -> None:
    wait_for(lambda: all(placement(agent, n)[0] == "nftables" for n in names), timeout,
             what=f"offload of {names}: {[placement(agent, n) for n in names]}")


def refused_within(front: Front, deadline: float) -> tuple[bool, list[str]]:
    """Connect (inside the client netns) until refused, never past `deadline`: a hang fails."""
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        seen.append(attempt(*front, timeout=left).kind)
        if seen[-1] == "refused":
            return True, seen
        time.sleep(0.01)
    return False, seen


def works_within(front: Front, deadline: float) -> tuple[bool, list[str]]:
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        seen.append(attempt(*front, timeout=left).kind)
        if seen[-1] == "ok":
            return True, seen
        time.sleep(0.01)
    return False, seen


# -- C05 ---------------------------------------------------------------------------------------------
C05_VIP = "10.96.30.30"


def test_c05_udp_sizes_whole_through_nftables(topology: Topology, tmp_path: Path, backends: Backends,
                                              agent_factory: Any) -> None:
    be = topology.add_host("be-a", "10.244.1.9")
    backends.start(be, "echo", "10.244.1.9", "7", "--udp")
    cli = topology.add_host("cli", CLIENT)
    m = Manifests(tmp_path / "m")
    m.write(svc("echo-udp", C05_VIP, [{"port": 7, "targetPort": 7, "protocol": "UDP"}]),
            slice_("echo-udp", [{"ip": "10.244.1.9", "ready": True}], [{"port": 7, "protocol": "UDP"}]))
    agent: AgentProc = agent_factory(m)
    agent.start()
    wait_offloaded(agent, "default/echo-udp")  # nothing is sent before: no conntrack entry to the relay
    before = relayed(agent)
    s = client_socket(cli, connect=(C05_VIP, 7))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    src = "%s:%d" % s.getsockname()
    good = 0
    with s:
        for size in C05_SIZES:
            for _ in range(3):
                sent = os.urandom(size)
                s.send(sent)
                echo = recv_whole(s)
                assert (len(echo), hashlib.sha256(echo).digest()) == (size, hashlib.sha256(sent).digest()), size
                good += 1
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):  # nothing split off or duplicated is left over
            s.recv(65535)
    assert good == 42
    assert relayed(agent) == before  # the relay carried none of it
    rows = [f for f in agent.flows() if f["original"]["src"] == src]
    assert [(f["datapath"], f["service"], f["endpoint"]) for f in rows] == \
        [("nftables", "default/echo-udp/UDP", "10.244.1.9:7")]
    # conntrack counts the reassembled datagrams: one packet per datagram each way, 28 header bytes
    assert (rows[0]["packets_in"], rows[0]["packets_out"]) == (42, 42)
    assert rows[0]["bytes_in"] == rows[0]["bytes_out"] == 3 * sum(C05_SIZES) + 42 * 28


# -- C11 ---------------------------------------------------------------------------------------------
C11_REPEATS, C11_STREAMS = 20, 16


def test_c11_every_byte_before_fin_through_nftables(topology: Topology, tmp_path: Path, backends: Backends,
                                                    agent_factory: Any) -> None:
    be = topology.add_host("bea", C11_BE)
    blob_log, upload_log = tmp_path / "blob.log", tmp_path / "upload.log"
    start_server(backends, be, "blob", C11_BE, str(BLOB), "--log", str(blob_log))
    start_server(backends, be, "upload", C11_BE, str(UPLOAD), "--log", str(upload_log))
    cli = topology.add_host("cli", CLIENT)
    m = Manifests(tmp_path / "m")
    m.write(*c11_objects())
    agent: AgentProc = agent_factory(m)
    agent.start()
    wait_offloaded(agent, "default/blob:blob", "default/blob:upload")
    before = relayed(agent)
    expected = {n: (n, pattern_digest(n)) for n in C11_SIZES}

    async def run() -> list[tuple[str, int, tuple[int, bytes]]]:
        gate = asyncio.Semaphore(C11_STREAMS)

        async def one(kind: str, n: int) -> tuple[str, int, tuple[int, bytes]]:
            async with gate:  # download() reads nothing for its first 100 ms
                return kind, n, await (download(n) if kind == "download" else upload(n))
        jobs = [one(kind, n) for _ in range(C11_REPEATS) for n in C11_SIZES for kind in ("download", "upload")]
        return await asyncio.gather(*jobs)

    t0 = time.monotonic()
    results = run_async(cli, run)
    elapsed = time.monotonic() - t0
    bad = [(kind, n, got[0]) for kind, n, got in results if got != expected[n]]
    assert not bad, f"{len(bad)} of {len(results)} transfers wrong (kind, L, received): {bad[:10]}"
    assert len(results) == 2 * C11_REPEATS * len(C11_SIZES)
    assert relayed(agent) == before, f"the relay carried some ({elapsed:.1f} s)"
    # the backends saw the client itself on every connection: DNAT, no proxy in between
    accepts = [line.split()[2].rsplit(":", 1)[0] for line in blob_log.read_text().splitlines()]
    assert Counter(accepts) == {CLIENT: C11_REPEATS * len(C11_SIZES)}
    uploads = [(line.split()[0].rsplit(":", 1)[0], line.split()[1]) for line in upload_log.read_text().splitlines()]
    assert Counter(uploads) == {(CLIENT, "eof"): C11_REPEATS * len(C11_SIZES)}


# -- C21 ---------------------------------------------------------------------------------------------
NODEPORTS = ("tcp . 30080", "tcp . 30443")


def unrelated(i: int) -> list[dict[str, Any]]:
    name = f"tmp-{i}"
    return [svc(name, f"10.96.{161 + i // 250}.{i % 250 + 1}", [{"port": 80, "targetPort": 8080}]),
            slice_(name, [{"ip": BE_S, "ready": True}], [{"port": 8080, "protocol": "TCP"}])]


def multi_elements(node: str) -> list[Element]:
    """Elements that belong to `multi`: its comments, ClusterIP or NodePort keys, or its pods."""
    pods = tuple(C21_BE.values())
    return [e for e in table_elements(node)
            if "default/multi:" in e[3] or MULTI in e[1] or e[1] in NODEPORTS
            or any(p in e[1] or p in e[2] for p in pods)]


def names_between(load: Load, t0: float, t1: float = float("inf")) -> set[str]:
    return {r[2] for r in load.between(t0, t1) if r[1] == "ok"}


def multi_http_state(agent: AgentProc) -> list[tuple[str, bool]]:
    row = next(s for s in agent.services() if s["servicePortName"] == "default/multi:http")
    return [(e["address"], e["ready"]) for e in row["endpoints"]]


def test_c21_reconcile_per_port_through_nftables(topology: Topology, tmp_path: Path, backends: Backends,
                                                 agent_factory: Any) -> None:
    logs: dict[str, Path] = {}
    for name, ip in C21_BE.items():
        ns = topology.add_host(name, ip)
        for port in (8080, 8443, 9090):
            logs[f"{name}:{port}"] = tmp_path / f"{name}-{port}.log"
            backends.start(ns, "idsrv", f"{name}:{port}", ip, str(port), "--log", str(logs[f"{name}:{port}"]))
    logs["be-s"] = tmp_path / "be-s.log"
    backends.start(topology.add_host("bes", BE_S), "idsrv", "be-s", BE_S, "8080", "--log", str(logs["be-s"]))
    cli = topology.add_host("cli", CLIENT)
    node = topology.node
    m = Manifests(tmp_path / "m")
    m.write(*multi(), *steady())
    agent: AgentProc = agent_factory(m)
    agent.start()
    wait_offloaded(agent, "default/multi:http", "default/multi:https", "default/steady")
    http_keys = (f"{MULTI} . tcp . 80", "tcp . 30080")
    a, b = C21_BE["be-a"], C21_BE["be-b"]
    # the windows in which multi:80 may fail: (delete written, re-create written + 1 s)
    outages: list[tuple[float, float]] = []
    took: dict[str, float] = {}  # how long each change took to be seen by the client (printed)
    with Load(cli, STEADY, 80).running() as st, Load(cli, MULTI, 80).running() as mu:
        time.sleep(0.5)
        before = relayed(agent)
        assert names_between(mu, 0.0) == {"be-a:8080", "be-b:8080"}

        # (1) http's targetPort 8080 -> 9090
        t1 = m.write(*multi(http_target=9090), *steady())
        wait_past(t1 + 1.5)
        assert names_between(mu, t1 + 1.0) == {"be-a:9090", "be-b:9090"}
        took["(1) last :8080"] = max((r[0] for r in mu.between(t1) if r[2].endswith(":8080")), default=t1) - t1
        assert [p for n in ("be-a:8080", "be-b:8080") for p in idsrv_log_after(logs[n], t1 + 1.0)] == []
        els = table_elements(node)
        assert {k: targets_of(els, k) for k in http_keys} == {k: {f"{a} . 9090", f"{b} . 9090"} for k in http_keys}
        assert targets_of(els, f"{MULTI} . tcp . 443") == {f"{a} . 8443", f"{b} . 8443"}

        # (2) the https port removed: refused within 1 s, its elements gone, :80 untouched
        t2 = m.write(*multi(http_target=9090, https=False), *steady())
        with inside(cli):
            for front in ((MULTI, 443), (NODE, 30443)):
                ok, seen = refused_within(front, t2 + 1.0)
                assert ok, (front, seen[-5:])
                took[f"(2) {front[1]} refused"] = time.monotonic() - t2
        wait_past(t2 + 1.0)
        with inside(cli):
            for front in ((MULTI, 443), (NODE, 30443)):
                assert {attempt(*front, timeout=1.0).kind for _ in range(10)} == {"refused"}, front
            assert attempt(NODE, 30080).name.endswith(":9090")
        els = table_elements(node)
        assert not [e for e in els if "multi:https" in e[3] or e[1] in (f"{MULTI} . tcp . 443", "tcp . 30443")]
        assert {k: targets_of(els, k) for k in http_keys} == {k: {f"{a} . 9090", f"{b} . 9090"} for k in http_keys}

        # (3) be-b's ready condition flipped 201 times in 10 s, ending not ready
        t3 = time.monotonic()
        t_last = t3
        for i in range(1, 202):
            t_last = m.write(*multi(http_target=9090, https=False, b_ready=i % 2 == 0), *steady())
            wait_past(t3 + i * 0.05)
        want = {k: {f"{a} . 9090"} for k in http_keys}
        assert wait_until(lambda: {k: targets_of(table_elements(node), k) for k in http_keys} == want,
                          t_last + 1.0 - time.monotonic(), 0.05), table_elements(node)
        assert multi_http_state(agent) == [(f"{a}:9090", True), (f"{b}:9090", False)]
        wait_past(t_last + 2.0)
        assert names_between(mu, t_last + 1.0) == {"be-a:9090"}
        assert idsrv_log_after(logs["be-b:9090"], t_last + 1.0) == []
        t_ready = m.write(*multi(http_target=9090, https=False), *steady())
        want = {k: {f"{a} . 9090", f"{b} . 9090"} for k in http_keys}
        assert wait_until(lambda: {k: targets_of(table_elements(node), k) for k in http_keys} == want,
                          t_ready + 1.0 - time.monotonic(), 0.05), table_elements(node)
        assert multi_http_state(agent) == [(f"{a}:9090", True), (f"{b}:9090", True)]
        wait_past(t_ready + 1.6)
        assert names_between(mu, t_ready + 1.0) == {"be-a:9090", "be-b:9090"}
        assert placement(agent, "default/multi:http")[0] == placement(agent, "default/steady")[0] == "nftables"
        assert relayed(agent) == before  # steps (1)-(3): every change applied in the kernel, as diffs

        # (4) multi deleted: every port of it refused within 1 s, no element of it left
        t4 = m.write(*steady())
        outages.append((t4, float("inf")))
        with inside(cli):
            for front in ((MULTI, 80), (NODE, 30080), (MULTI, 443), (NODE, 30443)):
                ok, seen = refused_within(front, t4 + 1.0)
                assert ok, (front, seen[-5:])
                took[f"(4) {front[1]} refused"] = time.monotonic() - t4
        assert wait_until(lambda: not multi_elements(node), t4 + 1.0 - time.monotonic(), 0.02), multi_elements(node)
        t_gone = time.monotonic()
        assert placement(agent, "default/multi:http")[0] == "absent"

        # (5) re-created within 100 ms of the delete taking effect: works again within 1 s
        t5 = m.write(*multi(http_target=9090, https=False), *steady())
        outages[-1] = (t4, t5 + 1.0)
        assert t5 - t_gone < 0.1
        with inside(cli):
            for front in ((MULTI, 80), (NODE, 30080)):
                ok, seen = works_within(front, t5 + 1.0)
                assert ok, (front, seen[-5:])
                took[f"(5) {front[1]} works"] = time.monotonic() - t5
        wait_offloaded(agent, "default/multi:http")
        els = table_elements(node)
        assert {k: targets_of(els, k) for k in http_keys} == want
        # (5b) deleted and re-created 50 ms apart (the manifest is polled every 200 ms, so the agent
        # may see the delete, or only the unchanged result): works within 1 s, offloaded after
        t_del = m.write(*steady())
        wait_past(t_del + 0.05)
        t5b = m.write(*multi(http_target=9090, https=False), *steady())
        outages.append((t_del, t5b + 1.0))
        with inside(cli):
            for front in ((MULTI, 80), (NODE, 30080)):
                ok, seen = works_within(front, t5b + 1.0)
                assert ok, (front, seen[-5:])
                took[f"(5b) {front[1]} works"] = time.monotonic() - t5b
        wait_past(t5b + 1.5)  # past a window that the delete may have started
        wait_offloaded(agent, "default/multi:http")
        assert {k: targets_of(table_elements(node), k) for k in http_keys} == want

        # (6) 500 unrelated Services: 5 created every 100 ms, each deleted 1.8 s after its creation
        time.sleep(0.3)
        baseline = len(table_elements(node))
        t6, created, peak = time.monotonic(), 0, baseline
        alive: list[tuple[float, int]] = []
        step = 0
        while created < 500 or alive:
            now = time.monotonic()
            alive = [(t, i) for t, i in alive if now - t < 1.8]
            if created < 500:
                alive += [(now, created + k) for k in range(5)]
                created += 5
            m.write(*multi(http_target=9090, https=False), *steady(), *(o for _, i in alive for o in unrelated(i)))
            if step % 4 == 3:
                peak = max(peak, len(table_elements(node)))
            step += 1
            wait_past(t6 + step * 0.1)
        t_end = time.monotonic()
        assert peak > baseline, "no unrelated Service was offloaded: the churn proved nothing"
        assert wait_until(lambda: len(table_elements(node)) == baseline, t_end + 2.0 - time.monotonic(), 0.1), \
            (baseline, len(table_elements(node)))
        assert not [e for e in table_elements(node) if "default/tmp-" in e[3] or e[1].startswith(("10.96.161.", "10.96.162."))]
        with inside(cli):
            for i in range(0, 500, 25):
                ip = unrelated(i)[0]["spec"]["clusterIP"]
                assert attempt(ip, 80, timeout=1.0).kind == "refused", ip
        time.sleep(0.3)
    assert failures(st.records) == [] and len(st.records) > 500
    assert {p.rsplit(":", 1)[0] for p in idsrv_log_after(logs["be-s"], 0.0)} == {CLIENT}  # never relayed
    unexpected: list[Record] = [r for r in failures(mu.records) if not any(t0 <= r[0] < t1 for t0, t1 in outages)]
    assert unexpected == [] and len(mu.records) > 500
    print(f"C21: {len(st.records)} connections to steady, {len(mu.records)} to multi:80, "
          f"element peak {peak} over baseline {baseline}; " + ", ".join(f"{k} {v:.2f}s" for k, v in took.items()))


# -- C22 ---------------------------------------------------------------------------------------------
DNS_FRONTS: tuple[Front, Front] = ((DNS, 53), (NODE, 30053))


def udp_answers(cli: str, dst: Front, tag: bytes, n: int = 100) -> list[bytes]:
    out = []
    for i in range(n):
        try:
            out.append(ask(cli, dst, tag + b"%d" % i))
        except OSError as err:
            out.append(repr(err).encode())
    return out


def test_c22_tcp_and_udp_on_one_port_through_nftables(topology: Topology, tmp_path: Path, backends: Backends,
                                                      agent_factory: Any) -> None:
    be_a = topology.add_host("bea", BE_A)
    tcp_log, udp_log = tmp_path / "tcp-be-a.log", tmp_path / "udp-be-a.log"
    backends.start(be_a, "idsrv", "tcp:be-a", BE_A, "5354", "--log", str(tcp_log))
    start_udpsrv(backends, be_a, "udp:be-a", BE_A, 5353, log=udp_log)
    backends.start(be_a, "idsrv", "WRONG:tcp-on-udp-target", BE_A, "5353")  # traps: the other protocol
    start_udpsrv(backends, be_a, "WRONG:udp-on-tcp-target", BE_A, 5354)
    be_x = topology.add_host("bex", BE_X)
    backends.start(be_x, "echo", BE_X, "7")
    start_udpsrv(backends, be_x, "WRONG:udp-to-echo-tcp", BE_X, 7)
    be_y = topology.add_host("bey", BE_Y)
    start_udpsrv(backends, be_y, "be-y", BE_Y, 7)
    backends.start(be_y, "idsrv", "WRONG:tcp-to-echo-udp", BE_Y, "7")
    cli = topology.add_host("cli", CLIENT)
    icmp_unlimited(topology)  # every UDP refusal counted (see its docstring)
    m = Manifests(tmp_path / "m")
    m.write(*c22_objects())
    agent: AgentProc = agent_factory(m)
    agent.start()
    wait_offloaded(agent, "kube-system/dns:dns", "kube-system/dns:dns-tcp", "default/echo-tcp", "default/echo-udp")
    els = table_elements(topology.node)
    assert targets_of(els, "udp . 30053") == {f"{BE_A} . 5353"} and targets_of(els, "tcp . 30053") == {f"{BE_A} . 5354"}
    assert targets_of(els, f"{DNS} . udp . 53") == {f"{BE_A} . 5353"}
    assert targets_of(els, f"{DNS} . tcp . 53") == {f"{BE_A} . 5354"}
    before = relayed(agent)

    with inside(cli):
        for front in DNS_FRONTS:
            got = Counter((o.kind, o.name) for o in (attempt(*front) for _ in range(100)))
            assert got == {("ok", "tcp:be-a"): 100}, front
        assert {tcp_echo(ECHO_TCP, 7) for _ in range(20)} == {b"hello"}
        assert {attempt(ECHO_UDP, 7, timeout=1.0).kind for _ in range(10)} == {"refused"}  # no TCP service there
    for front in DNS_FRONTS:
        assert udp_answers(cli, front, b"q") == [b"udp:be-a|q%d" % i for i in range(100)], front
    assert udp_answers(cli, (ECHO_UDP, 7), b"e") == [b"be-y|e%d" % i for i in range(100)]
    for _ in range(10):
        with pytest.raises(ConnectionRefusedError):
            ask(cli, (ECHO_TCP, 7), b"udp to a TCP-only service")
    assert relayed(agent) == before
    # ClusterIP traffic keeps the client's address (NodePort traffic is masqueraded): 100 each
    assert Counter(p.rsplit(":", 1)[0] for p in idsrv_log_after(tcp_log, 0.0))[CLIENT] == 100
    assert Counter(row[1] for row in read_backend_log(udp_log))[CLIENT] == 100

    # only the TCP port of dns removed while one connected UDP client per frontend keeps asking
    socks = [client_socket(cli, connect=front, timeout=1.0) for front in DNS_FRONTS]
    refused_after: dict[Front, float] = {}
    other: list[tuple[Front, str]] = []
    answered = sent = 0
    try:
        t0 = time.monotonic()
        t_upd: float | None = None
        while time.monotonic() < t0 + 2.5:
            if t_upd is None and time.monotonic() > t0 + 0.5:
                t_upd = m.write(*c22_objects(with_tcp=False))
            for s in socks:
                s.send(b"r%d" % sent)
                try:
                    answered += s.recv(65535) == b"udp:be-a|r%d" % sent
                except OSError:
                    pass
                sent += 1
            if t_upd is not None:
                with inside(cli):
                    for front in DNS_FRONTS:
                        if front not in refused_after:
                            o = attempt(*front, timeout=1.0)
                            if o.kind == "refused":
                                refused_after[front] = time.monotonic() - t_upd
                            elif o.kind != "ok":
                                other.append((front, o.kind))
            time.sleep(0.01)
    finally:
        for s in socks:
            s.close()
    assert answered == sent and sent > 200
    assert set(refused_after) == set(DNS_FRONTS) and max(refused_after.values()) <= 1.0, (refused_after, other)
    assert other == []
    with inside(cli):
        for front in DNS_FRONTS:
            assert {attempt(*front, timeout=1.0).kind for _ in range(20)} == {"refused"}, front
        assert tcp_echo(ECHO_TCP, 7) == b"hello"
    for front in DNS_FRONTS:
        assert udp_answers(cli, front, b"z") == [b"udp:be-a|z%d" % i for i in range(100)], front
    assert placement(agent, "kube-system/dns:dns")[0] == "nftables"
    assert placement(agent, "kube-system/dns:dns-tcp")[0] == "absent"
    els = table_elements(topology.node)
    assert not [e for e in els if "dns:dns-tcp" in e[3] or e[1] in ("tcp . 30053", f"{DNS} . tcp . 53")]
    assert targets_of(els, "udp . 30053") == targets_of(els, f"{DNS} . udp . 53") == {f"{BE_A} . 5353"}
    assert relayed(agent) == before  # neither protocol went through the relay
    print(f"C22: TCP refused {refused_after} after the update; UDP {answered}/{sent} answered meanwhile")
