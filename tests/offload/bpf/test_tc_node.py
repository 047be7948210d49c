"""NodePorts through tc with the real agent (`--offload bpf`) in one node's netns: on each rung
the kernel offers (tcx; a clsact qdisc's cls_bpf filters, forced here with --enable-tcx=false
and taken by itself on a kernel without tcx, as the lab's 6.1 guest runs this file), across
restarts, and across a restart that changes the map sizes.

Topology of the BPF tests (conftest.py): the node's usbr0 holds 192.0.2.10 and is the one hooked
interface; pod be-a (10.244.1.5) answers TCP and UDP on 8080; the client (10.244.9.10, outside
the socket LB's cgroup) reaches NodePorts 30080/TCP and 30081/UDP at 192.0.2.10. That tc carried
a flow: the tc programs' conntrack table holds it (pins), /flows lists it as bpf-tc, and the
relay, which still listens on the NodePorts under the tc hooks, counted no flow.

- each rung: new connections and a UDP exchange answered by the pod through tc; a long-lived TCP
  connection and UDP session talk across an agent restart (the programs swapped in place), and
  `usproxy run --cleanup` removes our programs; with clsact, a qdisc and filters of another
  program on usbr0 stay through all of it;
- sizes: the agent restarted with other --bpf-ct-global-*/--bpf-sock-rev-map-max values replaces
  the pinned maps by maps of the new sizes and carries their entries over, so the long-lived TCP
  connection through tc keeps its conntrack entry and talks on (without the carry-over its next
  segment meets no entry, goes to the stack and is reset: the relay listens on the NodePort); a
  restart with the same sizes reuses the very maps (same ids).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns import inside, nsexec
from tests.offload.bpf.agent import Agent
from tests.offload.bpf.conftest import Env
from usproxy.offload.bpf import cls_bpf, loader, nodeport
from usproxy.offload.bpf import libbpf as bpf
from usproxy.offload.bpf.layout import CT_MAPS, CT_ORIGINAL

pytestmark = pytest.mark.netns

NODE, CLIENT, POD = "192.0.2.10", "10.244.9.10", "10.244.1.5"
TCP_NP, UDP_NP = 30080, 30081
FOREIGN = ("bpf", "bytecode", "1,6 0 0 0,")  # another program's filter: classic BPF, no name
RUNGS = [pytest.param("tcx", marks=pytest.mark.skipif(cls_bpf.tcx_available() is not None,
                                                      reason="this kernel has no tcx")), "clsact"]


def manifests(path: Path) -> None:
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
           "spec": {"type": "NodePort", "clusterIP": "10.96.10.10", "ports": [
               {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": TCP_NP},
               {"name": "udp", "port": 80, "targetPort": 8080, "protocol": "UDP", "nodePort": UDP_NP}]}}
    eps = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
           "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "udp", "port": 8080, "protocol": "UDP"}],
           "endpoints": [{"addresses": [POD], "conditions": {"ready": True}}]}
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [svc, eps]}))


class TcAgent(Agent):
    """The BPF tests' agent with flags of its own, waiting until tc serves the NodePorts."""

    def __init__(self, env: Env, manifest: Path, log: Path, *flags: str) -> None:
        super().__init__(env, manifest, log)
        self.flags = flags

    def _cmd(self, *args: str) -> list[str]:
        return super()._cmd(*args, *self.flags) if "--services" in args else super()._cmd(*args)

    def wait_tc(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                rows = [r for r in self.get("/services") if r["servicePortName"].startswith("default/web:")]
                if len(rows) == 2 and all("bpf" in r["datapath"] and r["external"] == "tc" for r in rows):
                    return rows[0]
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"web never served at tc: {rows}\n{self.log.read_text()[-3000:]}")


def hold(env: Env, cli: str) -> subprocess.Popen[str]:
    """A long-lived TCP connection and UDP exchange to the NodePorts, outside the socket LB's cgroup."""
    proc = env.start(cli, "hold", NODE, TCP_NP, NODE, UDP_NP, in_cgroup=False)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "tick", proc.stderr
    return proc


def ended(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(input="", timeout=30)
    return dict(json.loads(out.strip().splitlines()[-1])) if out.strip() else {"error": err}


def tc_flows(env: Env) -> list[tuple[str, int]]:
    """(client address, NodePort) of the ORIGINAL entries in the tc programs' conntrack tables."""
    pins = loader.PinLayout(env.pin_root)
    fds = {name: bpf.obj_get(str(pins.maps / name)) for name in CT_MAPS}
    try:
        return [(str(e.saddr), e.dport) for e in nodeport.ct_entries(fds) if e.direction == CT_ORIGINAL]
    finally:
        for fd in fds.values():
            os.close(fd)


def pinned(env: Env, name: str) -> dict[str, str]:
    fd = bpf.obj_get(str(loader.PinLayout(env.pin_root).maps / name))
    try:
        return bpf.fdinfo(fd)
    finally:
        os.close(fd)


def removed(agent: TcAgent) -> None:
    """`usproxy run --cleanup` removed the BPF datapath's state (its exit status also counts the
    other datapaths: on a kernel without nf_tables, removing nftables' state fails)."""
    res = agent.cleanup()
    assert "bpf datapath: removed whatever of it was installed" in res.stderr, res.stderr[-3000:]


def our_filters(ns: str) -> dict[str, list[str]]:
    out = {}
    for hook in ("ingress", "egress"):
        text = nsexec(ns, "tc", "-j", "filter", "show", "dev", "usbr0", hook).stdout
        out[hook] = [f["options"].get("bpf_name", "bytecode" if "bytecode" in f["options"] else "?")
                     for f in json.loads(text or "[]") if "options" in f]
    return out


@pytest.mark.parametrize("rung", RUNGS)
def test_nodeports_are_served_at_tc_on_each_rung_across_a_restart(bpf_env: Env, tmp_path: Path, rung: str) -> None:
    ns = bpf_env.topo.node
    bpf_env.server("be-a", POD, 8080)
    cli = bpf_env.client_ns("cli", CLIENT)
    manifests(tmp_path / "services.yaml")
    flags = ("--enable-tcx=false",) if rung == "clsact" and cls_bpf.tcx_available() is None else ()
    if rung == "clsact":  # another program's qdisc and filters on the hooked interface
        nsexec(ns, "tc", "qdisc", "add", "dev", "usbr0", "clsact")
        for hook in ("ingress", "egress"):
            nsexec(ns, "tc", "filter", "add", "dev", "usbr0", hook, "prio", "50000", *FOREIGN)
    agent = TcAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "agent.log", *flags)
    agent.start()
    agent.wait_tc()
    assert f"at tc ({'tcx' if rung == 'tcx' else 'clsact + cls_bpf'}" in agent.log.read_text()
    relayed = agent.relay_flows()

    out = bpf_env.run(cli, "tcp", NODE, TCP_NP, 10, in_cgroup=False)
    assert out["errors"] == {} and out["names"] == {"be-a": 10}, out
    udp = bpf_env.run(cli, "udp", NODE, UDP_NP, 5, in_cgroup=False)
    assert udp["errors"] == {} and udp["names"] == {"be-a": 5} and udp["sources"] == {f"{NODE}:{UDP_NP}": 5}, udp
    assert agent.relay_flows() == relayed  # the relay carried none of them
    assert (CLIENT, TCP_NP) in tc_flows(bpf_env) and (CLIENT, UDP_NP) in tc_flows(bpf_env)
    assert any(f["datapath"] == "bpf-tc" for f in agent.get("/flows"))
    if rung == "clsact":
        filters = our_filters(ns)
        assert filters == {"ingress": ["usp_tc_ingress", "bytecode"], "egress": ["usp_tc_egress", "bytecode"]}, filters
        with inside(ns):
            assert cls_bpf.tcx_available() is not None or bpf.prog_query(socket.if_nametoindex("usbr0"),
                                                                        bpf.BPF_TCX_INGRESS) == []

    long_lived = hold(bpf_env, cli)
    agent.stop()  # the programs stay; a new agent swaps them in place
    agent.start()
    agent.wait_tc()
    assert bpf_env.run(cli, "tcp", NODE, TCP_NP, 5, in_cgroup=False)["errors"] == {}
    time.sleep(1)
    agent.stop()
    summary = ended(long_lived)
    assert summary.get("fails") == 0 and summary["tcp_ok"] > 10 and summary["udp_names"] == {"be-a": summary["tcp_ok"]}, \
        summary

    removed(agent)
    assert not bpf_env.pin_root.exists()
    if rung == "clsact":
        assert our_filters(ns) == {"ingress": ["bytecode"], "egress": ["bytecode"]}  # another's stay
        assert "clsact" in nsexec(ns, "tc", "qdisc", "show", "dev", "usbr0").stdout


def test_a_restart_with_other_map_sizes_carries_the_flows_over(bpf_env: Env, tmp_path: Path) -> None:
    bpf_env.server("be-a", POD, 8080)
    cli = bpf_env.client_ns("cli", CLIENT)
    manifests(tmp_path / "services.yaml")
    small = ("--bpf-ct-global-tcp-max", "4096", "--bpf-ct-global-any-max", "2048", "--bpf-sock-rev-map-max", "2048")
    agent = TcAgent(bpf_env, tmp_path / "services.yaml", tmp_path / "agent.log", *small)
    agent.start()
    agent.wait_tc()
    assert pinned(bpf_env, "usp_ct")["max_entries"] == "4096"
    long_lived = hold(bpf_env, cli)
    time.sleep(1)
    agent.stop()
    ct_before = pinned(bpf_env, "usp_ct")["map_id"]

    agent.flags = ("--bpf-ct-global-tcp-max", "8192", "--bpf-ct-global-any-max", "4096", "--bpf-sock-rev-map-max", "1024")
    agent.start()
    agent.wait_tc()
    assert "usp_ct resized from 4096 to 8192 entries" in agent.log.read_text()
    now = pinned(bpf_env, "usp_ct")
    assert now["max_entries"] == "8192" and now["map_id"] != ct_before
    assert pinned(bpf_env, "usp_revnat")["max_entries"] == "1024"
    assert (CLIENT, TCP_NP) in tc_flows(bpf_env)  # the long-lived connection's entry, carried over
    time.sleep(1)
    agent.stop()
    same, resizes = pinned(bpf_env, "usp_ct")["map_id"], agent.log.read_text().count(" resized from ")
    agent.start()  # the same sizes: the very same maps
    agent.wait_tc()
    assert pinned(bpf_env, "usp_ct")["map_id"] == same and agent.log.read_text().count(" resized from ") == resizes
    time.sleep(1)
    agent.stop()
    summary = ended(long_lived)
    assert summary.get("fails") == 0 and summary["tcp_ok"] > 10, summary
    removed(agent)
