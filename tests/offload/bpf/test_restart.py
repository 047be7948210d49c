"""Agent restart and cleanup (C20): pinned programs and maps outlive the agent.

An "agent" subprocess installs two Services and exits without cleaning up; traffic keeps flowing
with no agent at all. A new agent reads the maps back, reconciles with zero writes when nothing
changed, and swaps the programs in place (BPF_LINK_UPDATE) without disturbing a long-lived TCP
connection or a UDP socket's endpoint. `cleanup()` then detaches everything and removes the pins.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.offload.bpf.builders import WEB, ep, state, web_and_quic
from tests.offload.bpf.conftest import Env, attached_programs
from usproxy.offload.bpf import loader
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.offload.bpf.view import render_pinned

pytestmark = pytest.mark.netns


AGENT = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.offload.bpf.builders import web_and_quic
from usproxy.offload.bpf.datapath import BpfDatapath
from usproxy.offload.bpf.view import render_pinned
dp = BpfDatapath(Path({cgroup!r}), Path({pins!r}))
asyncio.run(dp.apply(web_and_quic()))
print(dp.dump(), flush=True)
"""  # exits without cleanup, as a SIGKILLed agent would


def _ticks(proc: subprocess.Popen[str], n: int) -> None:
    assert proc.stdout is not None
    for _ in range(n):
        assert proc.stdout.readline().strip() == "tick", proc.stderr.read() if proc.stderr else ""


async def test_restart_keeps_traffic_and_reconciles_without_writes(bpf_env: Env) -> None:
    for short, ip, port in (("be-a", "10.244.1.50", 8080), ("be-b", "10.244.2.50", 8080),
                            ("be-c", "10.244.3.50", 4433), ("be-d", "10.244.4.50", 4433)):
        bpf_env.server(short, ip, port)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    script = AGENT.format(root=str(Path(__file__).parents[3]), cgroup=str(bpf_env.cgroup),
                          pins=str(bpf_env.pin_root))
    first = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr

    hold = bpf_env.start(cli, "hold", "10.96.150.150", 80, "10.96.150.151", 4433)
    _ticks(hold, 10)
    # no agent runs now: new connections still work, and the pinned state can be read
    assert bpf_env.run(cli, "tcp", "10.96.150.150", 80, 20)["errors"] == {}
    text = render_pinned(bpf_env.pin_root)
    assert text is not None and "link usp_connect4" in text and "steered sockets open: 2" in text

    restarted = BpfDatapath(bpf_env.cgroup, bpf_env.pin_root)
    bpf_env.dp = restarted
    back = await restarted.read_back()
    assert back == {name: st.cluster_endpoints for name, st in web_and_quic().items() if st is not None}
    assert restarted.dump() == first.stdout.strip()
    await restarted.apply(web_and_quic())
    assert restarted.last_writes == 0  # reconciled as a diff: nothing to write
    _ticks(hold, 10)
    flows = restarted.flows_view()
    assert sorted((f["protocol"], f["service"], f["original"]["dst"]) for f in flows) == [
        ("TCP", "default/web", "10.96.150.150:80"), ("UDP", "default/quic", "10.96.150.151:4433")]

    out, _ = hold.communicate(input="", timeout=10)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["fails"] == 0 and summary["tcp_ok"] >= 20, summary
    assert len(summary["udp_names"]) == 1, summary  # the UDP socket kept its endpoint
    assert summary["udp_sources"] == {"10.96.150.151:4433": sum(summary["udp_names"].values())}


async def test_cleanup_detaches_and_unpins(bpf_env: Env) -> None:
    bpf_env.server("be-a", "10.244.1.50", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({WEB: state(WEB, "10.96.150.150", 80, [ep("10.244.1.50")])})
    assert set(attached_programs(bpf_env.cgroup)) == set(loader.PROGRAMS)
    assert bpf_env.run(cli, "tcp", "10.96.150.150", 80, 10)["names"] == {"be-a": 10}

    await bpf_env.dp.cleanup()

    assert attached_programs(bpf_env.cgroup) == {}
    assert not bpf_env.pin_root.exists()
    out = bpf_env.run(cli, "tcp", "10.96.150.150", 80, 3)
    assert out["names"] == {}  # the ClusterIP is no longer translated
