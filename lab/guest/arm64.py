"""The arm64 board: the same wheel as every amd64 guest, installed unchanged. The BPF object the
agent loads is the wheel's prebuilt one (there is no clang in the guest): its sha256 and ELF
machine (EM_BPF, 247: bytecode, not arm64 code) are reported, so the host compares them with the
object an amd64 guest loaded from the same wheel.

Then, with two pods and a client: the agent relays a ClusterIP (--offload none); is restarted
with --offload nftables while a long-lived TCP connection and a UDP session talk (relay ->
nftables: they keep talking, new connections are carried by the kernel, as /flows shows); then
with --offload bpf, where a process in the socket LB's cgroup connects to the ClusterIP,
getpeername() says the ClusterIP while the pod answered it directly (no relay flow). `usproxy
explain` renders the Services, `explain --live` the running agent's state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import manifests
import node
import traffic
from agent import Agent, cleanup
from node import say, sh
from result import BPF_CGROUP, WORK
from traffic import held_probe, wait_serving

EM_BPF = 247
LOCAL_CLIENT = """
import json, os, socket, sys
open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid()))
s = socket.create_connection(("10.96.0.10", 80), timeout=10)
s.sendall(b"probe\\n")
reply = s.makefile("rb").readline().decode()
print(json.dumps({"peer": s.getpeername()[0], "sport": s.getsockname()[1], "pod": reply.split(" ")[0]}), flush=True)
sys.stdin.readline()
"""


def bpf_object() -> dict[str, Any]:
    """The object the agent will load (usproxy.offload.bpf.build.object_path): the wheel's prebuilt one."""
    code = ("import hashlib, json; from usproxy.offload.bpf.build import object_path; p = object_path(); "
            "b = p.read_bytes(); print(json.dumps({'path': str(p), 'sha256': hashlib.sha256(b).hexdigest(), "
            "'e_machine': int.from_bytes(b[18:20], 'little'), 'bytes': len(b)}))")
    out = sh(sys.executable, "-c", code, check=False)
    try:
        return dict(json.loads(out.stdout))
    except ValueError:
        return {"error": out.stderr.strip()[-400:]}


def local_probe(agent: Agent, cgroup: Path) -> dict[str, Any]:
    """A process in the socket LB's cgroup connects to the ClusterIP; while it is open, /flows."""
    proc = subprocess.Popen([sys.executable, "-c", LOCAL_CLIENT, str(cgroup)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        seen: dict[str, Any] = json.loads(line) if line else {"error": proc.stderr.read() if proc.stderr else ""}
        if "sport" in seen:
            seen["flows"] = [f for f in agent.get("/flows")
                             if str(f.get("original", {}).get("src", "")).endswith(f":{seen['sport']}")]
            seen["relay_flows"] = [f for f in seen["flows"] if f.get("datapath") == "userspace"]
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.wait(timeout=30)
    return seen


def run(res: Any) -> None:
    obj = bpf_object()
    res.data["bpf_object"] = obj
    res.expect(obj.get("e_machine") == EM_BPF, f"the BPF object is not BPF bytecode: {obj}")
    res.expect("/site-packages/usproxy/" in str(obj.get("path", "")), f"the agent's BPF object is not the wheel's: {obj}")
    caps = __import__("proofs").check_json()
    res.data["check"] = caps
    pods = node.build(2)
    node.start_servers(2, [manifests.TCP_PORT], [manifests.UDP_PORT])
    frontends = manifests.kernel_scenario(WORK / "services", pods)
    web, dns = frontends["default/web:p"], frontends["default/dns:p"]
    fig = res.data["figures"]
    steps: dict[str, Any] = {}
    res.data["steps"] = steps

    # 1. the relay alone
    agent = Agent(WORK / "services", "--offload", "none", label="agent-relay")
    fig["agent_start_s"] = agent.start_s
    wait_serving(res, {"web": web, "dns": dns})
    steps["relay"] = {"web": held_probe(agent, *web), "dns": held_probe(agent, *dns), "datapaths": agent.datapaths()}
    res.expect(steps["relay"]["web"]["carried_by"] == "userspace", f"relay: {steps['relay']}")
    fig["agent_rss_kib"] = agent.rss_kib()
    agent.stop()

    # 2. nftables: long-lived flows across relay -> kernel
    agent = Agent(WORK / "services", "--offload", "nftables", "--offload-after", "5", label="agent-nftables")
    wait_serving(res, {"web": web, "dns": dns})
    flows = [traffic.Flow("tcp clusterIP", web[0], web[1], "TCP", 0.25).start(),
             traffic.Flow("udp clusterIP", dns[0], dns[1], "UDP", 0.1).start()]
    t = time.monotonic()
    landed = agent.wait_datapaths({"default/web:p": "nftables", "default/dns:p": "nftables"}, 120)
    fig["nftables_offload_s"] = round(time.monotonic() - t, 1)
    time.sleep(3)
    steps["nftables"] = {"datapaths": landed, "web": held_probe(agent, *web), "dns": held_probe(agent, *dns),
                         "distribution": traffic.probe_many(web[0], web[1], "TCP", 8)}
    time.sleep(2)
    steps["nftables"]["long_lived"], errors = traffic.summary(flows)
    steps["nftables"]["explain_live"] = sh("usproxy", "explain", "--services", str(WORK / "services"), "--live",
                                           check=False, timeout=300).returncode
    res.expect(landed.get("default/web:p") == "nftables", f"nftables: web on {landed}")
    res.expect(steps["nftables"]["web"]["carried_by"] == "nftables", f"nftables: new connection {steps['nftables']['web']}")
    res.expect(errors == 0, f"long-lived flows across relay -> nftables: {steps['nftables']['long_lived']}")
    agent.stop()
    cleanup()

    # 3. BPF: the socket LB for processes in its cgroup
    BPF_CGROUP.mkdir(exist_ok=True)
    agent = Agent(WORK / "services", "--offload", "bpf", "--offload-after", "2", "--bpf-cgroup", str(BPF_CGROUP),
                  label="agent-bpf")
    t = time.monotonic()
    landed = agent.wait_datapaths({"default/web:p": "bpf"}, 120)
    fig["bpf_offload_s"] = round(time.monotonic() - t, 1)
    steps["bpf"] = {"datapaths": landed, "local": local_probe(agent, BPF_CGROUP)}
    local = steps["bpf"]["local"]
    res.expect(landed.get("default/web:p") == "bpf", f"bpf: web on {landed}")
    res.expect(local.get("peer") == web[0] and str(local.get("pod", "")).startswith("pod-") and not local.get("relay_flows"),
               f"bpf: a connect() in the cgroup was not served by the socket LB: {local}")
    agent.stop()
    cleanup()

    explain = sh("usproxy", "explain", "--services", str(WORK / "services"), "--mode", "all", check=False, timeout=300)
    (node.OUT / "explain.txt").write_text(explain.stdout + explain.stderr)
    steps["explain"] = {"exit": explain.returncode, "lines": len(explain.stdout.splitlines())}
    res.expect(explain.returncode == 0 and "10.96.0.10" in explain.stdout, f"explain: exit {explain.returncode}")
    res.expect(steps["nftables"]["explain_live"] == 0, "explain --live failed against the nftables agent")
    res.data["datapaths"] = {"relay": steps["relay"]["datapaths"], "nftables": steps["nftables"]["datapaths"],
                             "bpf": steps["bpf"]["datapaths"]}
    say(f"arm64: relay, nftables and bpf done; BPF object {obj.get('sha256', '?')[:16]}")
