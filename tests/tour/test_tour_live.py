"""The tour live, as root, with a small plan: its figures are held to the datapaths' and the
endpoints' own counters, read by this test itself while each mode's agent still runs.

- the endpoints' own accept counts equal the connections the tour saw answered, endpoint by
  endpoint (every mode), and the uniformity figures are exactly the endpoints' counts;
- iptables: the packet counters of the KUBE-SEP DNAT rules of Service `uniform` (iptables-save
  -c: the nat table sees a connection's first packet only) equal the tour's uniformity counts;
- BPF: the kernel's own per-backend selection counters (map usp_backends, pinned under the
  tour's pin root) equal them too;
- the relay: its flow counter (usproxy_flows_total) equals every connection the tour made; in
  the kernel modes it stays 0: the kernel carried them all;
- what one endpoint change sent, as the tour reports it, behaves as each datapath's layout says:
  iptables' grows with the Services (its KUBE-SERVICES rewrite), nftables' and BPF's do not;
- afterwards nothing of the tour is left: namespaces, cgroup, pins, state file, processes; also
  after SIGTERM in the middle of a visit, and after kill -9 once the next tour's sweep has run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.layout import BackendVal
from usproxy.offload.bpf.loader import PinLayout
from usproxy.tour import manifests as m
from usproxy.tour import network, runner
from usproxy.tour.network import nsexec
from usproxy.tour.visit import Plan, Visit

pytestmark = pytest.mark.netns

SMALL = Plan(sizes=(6, 60), rounds=1, window=0.2, conc=8, latency_count=20, changes=2, uniform_count=600)
ROOT = Path(__file__).resolve().parents[2]
UNIFORM = tuple(f"{ip}:{m.UNIFORM_PORT}" for ip in m.ENDPOINTS)


def sep_packets(v: Visit) -> dict[str, int]:
    """iptables: "address:port" of each KUBE-SEP DNAT rule -> its packet counter."""
    text = nsexec(v.net.node, f"{v.result.backend}-save", "-c", "-t", "nat").stdout
    return {m_.group(2): int(m_.group(1)) for m_ in
            re.finditer(r"^\[(\d+):\d+\] -A KUBE-SEP-\S+ .*--to-destination (\S+)", text, re.M)}


def bpf_selected(v: Visit) -> dict[str, int]:
    """BPF: "address:port" of each backend -> how often the kernel chose it."""
    fd = bpf.obj_get(str(PinLayout(v.net.pin_root).maps / "usp_backends"))
    try:
        out: dict[str, int] = {}
        for key in bpf.map_keys(fd, 4):
            raw = bpf.map_lookup(fd, key, BackendVal.SIZE)
            if raw is not None:
                b = BackendVal.unpack(raw)
                out[f"{b.ip}:{b.port}"] = out.get(f"{b.ip}:{b.port}", 0) + b.selected
        return out
    finally:
        os.close(fd)


def relay_flows(v: Visit) -> float:
    assert v.agent is not None
    return sum(val for (name, labels), val in v.agent.metrics().items()
               if name == "usproxy_flows_total" and dict(labels).get("protocol") == "TCP")


def test_the_tours_figures_are_the_datapaths_own(tmp_path: Path) -> None:
    seen: dict[str, dict[str, Any]] = {}

    def check(v: Visit) -> None:
        assert v.endpoints is not None
        r = v.result
        own = v.endpoints.counts()
        counted: dict[str, Any] = {"own": own, "client": dict(r.client_counts), "errors": r.client_errors,
                                   "relay_flows": relay_flows(v), "token": v.net.token}
        if r.mode == "iptables":
            counted["kernel"] = sep_packets(v)
        if r.mode == "bpf":
            counted["kernel"] = bpf_selected(v)
        seen[r.mode] = counted

    rc = runner.run(tmp_path, SMALL, ("relay", "iptables", "ipvs", "nftables", "bpf"), say=lambda _: None, after=check)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, [(x["mode"], x["error"]) for x in doc["modes"]]
    modes = {x["mode"]: x for x in doc["modes"]}
    assert list(modes) == ["relay", "iptables", "ipvs", "nftables", "bpf"]
    assert modes["ipvs"]["available"] is False and "ipvs" in modes["ipvs"]["why"]
    for name in ("relay", "iptables", "nftables", "bpf"):
        r, c = modes[name], seen[name]
        assert r["error"] == "" and c["errors"] == 0, (name, r["error"], c["errors"])
        # every connection the tour saw answered is one the endpoint counted, and no other
        assert c["own"] == {spec: c["client"].get(spec, 0) for spec in c["own"]}, name
        assert r["endpoint_counts"] == c["own"] and r["client_counts"] == c["client"]
        uni = r["uniformity"]
        assert uni["connections"] == SMALL.uniform_count
        assert list(uni["counts"]) == [c["own"][s] for s in UNIFORM] == list(uni["endpoint_counts"]), name
        if "kernel" in c:  # the kernel's own count of its choices for Service `uniform`
            assert [c["kernel"].get(s, 0) for s in UNIFORM] == list(uni["counts"]), name
        total = sum(c["client"].values())
        assert c["relay_flows"] == (total if name == "relay" else 0), name
        assert [u["services"] for u in r["update"]] == list(SMALL.sizes)
        assert all(s is not None for u in r["update"] for s in u["seconds"])
        assert {x["services"] for x in r["match"]} == set(SMALL.sizes)
        assert r["served_by"][m.LAST.key] == ("userspace" if name == "relay" else name)
    writes = {name: [min(u["kernel_writes"]) for u in modes[name]["update"]] for name in ("iptables", "nftables", "bpf")}
    assert writes["iptables"][1] - writes["iptables"][0] >= 54  # a KUBE-SERVICES rule per Service more
    assert writes["nftables"][0] == writes["nftables"][1] and writes["bpf"][0] == writes["bpf"][1]
    assert modes["relay"]["update"][0]["kernel_writes"] is None
    walked = {x["position"]: x["rules_walked"] for x in modes["iptables"]["match"] if x["services"] == 60}
    assert walked == {"first": 1, "last": 60}
    assert {p["file"] for p in doc["plots"]} <= {f.name for f in tmp_path.glob("*.svg")}
    nothing_left(seen["relay"]["token"])


def nothing_left(token: str) -> None:
    net = network.TourNetwork(token)
    assert not [ns for ns in os.listdir("/run/netns") if ns.startswith(net.name)]
    assert not net.cgroup.exists() and not net.pin_root.exists() and not net.state.exists()


def start_tour(tmp_path: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "usproxy", "tour", "--quick", "--modes", mode,
                             "--out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def mid_visit(tour: subprocess.Popen[bytes], timeout: float = 120.0) -> tuple[str, list[int]]:
    """Wait until the tour's agent serves; its token and the pids in its node namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert tour.poll() is None, "the tour ended before its visit"
        for f in network.STATE_DIR.glob("tour-*.json"):
            st = json.loads(f.read_text())
            if st["pid"] == tour.pid and os.path.exists(f"/run/netns/{st['netns'][0]}"):
                ps = subprocess.run(["ip", "netns", "pids", st["netns"][0]], capture_output=True, text=True)
                pids = [int(p) for p in ps.stdout.split()]
                if len(pids) >= 2 and any(_is_agent(p) for p in pids):  # the agent and the client
                    return f.name.removeprefix("tour-").removesuffix(".json"), pids
        time.sleep(0.2)
    raise TimeoutError("the tour's visit did not start")


def _is_agent(pid: int) -> bool:
    """`usproxy run` (the visit's agent), not `usproxy check` (the tour's probe, in a namespace of
    the same kind, whose children made the wait end before the visit once)."""
    try:
        return b"usproxy\0run\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}")]:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_in_the_middle_of_a_visit_leaves_nothing(tmp_path: Path) -> None:
    tour = start_tour(tmp_path, "bpf")
    try:
        token, pids = mid_visit(tour)
        time.sleep(1.0)
        tour.send_signal(signal.SIGTERM)
        assert tour.wait(60) == 130
    finally:
        if tour.poll() is None:
            tour.kill()
    assert gone(pids)
    nothing_left(token)


def test_after_kill_9_the_next_tours_sweep_removes_what_was_left(tmp_path: Path) -> None:
    tour = start_tour(tmp_path, "bpf")
    try:
        token, pids = mid_visit(tour)
        time.sleep(1.0)
        tour.kill()
        tour.wait(10)
    finally:
        if tour.poll() is None:
            tour.kill()
    net = network.TourNetwork(token)
    assert net.state.exists() and net.cgroup.exists()  # left behind
    removed = network.sweep()
    assert any(net.node in r for r in removed)
    assert gone(pids)
    nothing_left(token)
