"""A lab scenario, run inside the guest by init.sh; writes /lab/out/result.json and exits 0 when it
passed (the host reads the file; the exit status is a second opinion).

Kernel scenarios (no-nftables, no-xtables, cgroup1, ipvs): prove what is missing, compare `usproxy
check`, then start the agent (`--offload auto`) on a ClusterIP, a NodePort and a UDP Service with
three pods, and drive traffic from the client namespace: probes before offload (the relay), a
long-lived TCP connection to the ClusterIP and to the NodePort and a UDP session that keep
talking while the agent moves the ServicePorts from the relay to the kernel, and probes after.
Which datapath carried each probe is read from the agent's /flows while the probe's connection is
open. The ServicePorts must land where the kernel allows: the part of the datapath that serves
forwarded traffic (what is not "bpf") must be the expected rung of the ladder.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifests  # noqa: E402
import node  # noqa: E402
import proofs  # noqa: E402
import traffic  # noqa: E402
from agent import Agent, cleanup  # noqa: E402
from node import say  # noqa: E402
from result import BPF_CGROUP, PARAMS, WORK, Result, meminfo  # noqa: E402
from traffic import held_probe, wait_serving  # noqa: E402

def forwarded_part(datapath: str) -> str:
    """The datapath serving forwarded traffic: what is not the socket LB ("bpf" serves only
    processes on the node), or the relay when nothing else is listed."""
    rest = [d for d in datapath.split("+") if d != "bpf"]
    return "+".join(rest) if rest else "userspace"


def same_datapath(a: str, b: str) -> bool:
    """"bpf+nftables" and "nftables+bpf" are the same placement."""
    return set(a.split("+")) == set(b.split("+"))


def prove_missing(res: Result, features: list[str]) -> dict[str, bool]:
    """Each feature taken away must be gone; returns feature -> present for the check comparison."""
    facts = {}
    for feature in features:
        found = proofs.cgroup2() if feature == "cgroup2" else proofs.module(feature)
        res.data["missing"][feature] = found
        facts[feature] = bool(found["present"])
        res.expect(not found["present"], f"{feature} was to be missing but is present: {found}")
    return facts


def prove_present(res: Result, features: list[str]) -> dict[str, bool]:
    facts = {}
    for feature in features:
        found = {"cgroup2": proofs.cgroup2, "ip_vs": proofs.ipvs}.get(feature, lambda: proofs.module(feature))()
        res.data["present"][feature] = found
        facts[feature] = bool(found["present"])
        res.expect(bool(found["present"]), f"{feature} was to be present but is not: {found}")
    return facts


def kernel_expectation(res: Result, caps: list[dict[str, Any]]) -> tuple[str, bool]:
    """(forwarded datapath expected, socket LB expected) for this scenario."""
    name = PARAMS["scenario"]
    bpf = name != "cgroup1"
    if name == "no-nftables":
        built = proofs.datapath_built(caps, "iptables")
        res.data["iptables_datapath"] = "built" if built else "not built yet: the relay serves instead"
        return ("iptables" if built else "userspace"), bpf
    if name == "no-xtables":
        return "userspace", bpf
    if name == "ipvs":  # with the IPVS datapath the agent runs --offload ipvs (kernel_scenario)
        built = proofs.datapath_built(caps, "ipvs")
        if not built:
            res.data["pending"] = "ipvs datapath not built yet"
        return ("ipvs" if built else "nftables"), bpf
    return "nftables", bpf  # cgroup1


def kernel_scenario(res: Result) -> None:
    name = PARAMS["scenario"]
    gone = {"no-nftables": ["nf_tables"], "no-xtables": ["nf_tables", "x_tables", "ip_tables"],
            "cgroup1": ["cgroup2"], "ipvs": []}[name]
    needed = {"no-nftables": ["ip_tables", "cgroup2"], "no-xtables": ["cgroup2"], "cgroup1": ["nf_tables"],
              "ipvs": ["ip_vs", "nf_tables", "cgroup2"]}[name]
    if name == "no-nftables":  # iptables-nft cannot work without nf_tables: this node uses legacy
        node.sh("update-alternatives", "--set", "iptables", "/usr/sbin/iptables-legacy")
    facts = {**prove_missing(res, gone), **prove_present(res, needed)}
    say(f"features: {facts}")
    caps = proofs.check_json()
    res.data["check"] = caps
    res.data["check_disagrees"] = proofs.compare(caps, facts)
    for wrong in res.data["check_disagrees"]:
        res.fail(f"usproxy check disagrees with the kernel: {wrong}")
    forwarded, socket_lb = kernel_expectation(res, caps)
    from arm64 import bpf_object  # the same report on every architecture: compared by the host
    res.data["bpf_object"] = bpf_object()

    pods = node.build(3)
    node.start_servers(3, [manifests.TCP_PORT], [manifests.UDP_PORT])
    frontends = manifests.kernel_scenario(WORK / "services", pods)
    flags = ["--offload", "auto", "--offload-after", "5"]
    if forwarded == "ipvs":  # the ladder puts nftables before IPVS, and this kernel has both: ask for it
        flags[1], socket_lb = "ipvs", False
    if socket_lb:
        BPF_CGROUP.mkdir(exist_ok=True)
        flags += ["--bpf-cgroup", str(BPF_CGROUP)]
    res.data["figures"]["mem_available_before_agent_kib"] = meminfo("MemAvailable")
    agent = Agent(WORK / "services", *flags)
    res.data["figures"]["agent_start_s"] = agent.start_s
    try:
        traffic_through(res, agent, frontends, forwarded, socket_lb)
    finally:
        res.data["figures"]["agent_rss_kib"] = agent.rss_kib()
        # the node's memory the agent took, its RSS plus what it made the kernel hold (BPF maps)
        res.data["figures"]["mem_taken_kib"] = res.data["figures"]["mem_available_before_agent_kib"] - meminfo("MemAvailable")
        res.data["figures"]["agent_cpu_s"] = round(agent.cpu_s(), 2)
        res.expect(agent.stop() in (0, -15), "agent did not exit cleanly on SIGTERM")
        res.data["datapath_log"] = datapath_lines(agent.log)
        cleanup()


def datapath_lines(log: Path) -> list[str]:
    """The agent's own words on each kernel datapath ("kernel datapath bpf: unavailable (...)")."""
    return [line.split(": ", 1)[1] for line in log.read_text(errors="replace").splitlines() if "kernel datapath " in line]


def traffic_through(res: Result, agent: Agent, frontends: dict[str, tuple[str, int, str]], forwarded: str,
                    socket_lb: bool) -> None:
    probes: dict[str, Any] = {"before": {}, "after": {}}
    wait_serving(res, {**frontends, "nodePort": (node.NODE_IP, 30080, "TCP")})
    for spn, (ip, port, proto) in frontends.items():
        probes["before"][spn] = held_probe(agent, ip, port, proto)
    probes["before"]["nodeport 192.0.2.10:30080"] = held_probe(agent, node.NODE_IP, 30080, "TCP")
    flows = [traffic.Flow("tcp clusterIP", "10.96.0.10", 80, "TCP", 0.25).start(),
             traffic.Flow("tcp nodePort", node.NODE_IP, 30080, "TCP", 0.25).start(),
             traffic.Flow("udp clusterIP", "10.96.0.53", 53, "UDP", 0.1, may_move=forwarded == "ipvs").start()]
    parts = ({forwarded} - {"userspace"}) | ({"bpf"} if socket_lb else set())
    want = {spn: "+".join(sorted(parts)) or "userspace" for spn in frontends}
    res.data["expected"] = want
    start = time.monotonic()
    landed = agent.wait_datapaths(want, timeout=120 if forwarded != "userspace" else 20)
    res.data["figures"]["offload_s"] = round(time.monotonic() - start, 1)
    time.sleep(3)
    res.data["datapaths"] = agent.datapaths()
    res.data["reasons"] = agent.reasons()
    for spn, ok in want.items():
        got = res.data["datapaths"].get(spn, "")
        res.expect(same_datapath(got, ok), f"{spn} on {got!r} ({res.data['reasons'].get(spn)}), expected {ok!r}")
    for spn, (ip, port, proto) in frontends.items():
        probes["after"][spn] = held_probe(agent, ip, port, proto)
    probes["after"]["nodeport 192.0.2.10:30080"] = held_probe(agent, node.NODE_IP, 30080, "TCP")
    probes["distribution"] = {spn: traffic.probe_many(ip, port, proto, 12) for spn, (ip, port, proto) in frontends.items()}
    time.sleep(3)  # the long-lived flows go on talking on the kernel path
    res.data["long_lived"], errors = traffic.summary(flows)
    res.data["probes"] = probes
    res.data["status"] = agent.status_json()
    del landed
    res.expect(errors == 0, f"long-lived flows had {errors} errors: {res.data['long_lived']}")
    for f in res.data["long_lived"]:
        res.expect(int(f["exchanges"]) > 10, f"long-lived flow {f['flow']} barely talked: {f}")
    for phase in ("before", "after"):
        for what, p in probes[phase].items():
            res.expect(not p["pod"].startswith("error"), f"probe {phase} offload to {what} failed: {p}")
    for what, p in probes["before"].items():
        res.expect("userspace" in p["carried_by"] or "relay" in p["carried_by"],
                   f"before offload, {what} was carried by {p['carried_by']}, not the relay")
    for what, seen in probes["distribution"].items():
        res.expect(not any(k.startswith("error") for k in seen) and len(seen) >= 2,
                   f"12 new connections to {what}: {seen} (errors, or not spread over the pods)")
    if forwarded == "userspace":
        for what, p in probes["after"].items():
            res.expect("userspace" in p["carried_by"] or "relay" in p["carried_by"],
                       f"{what} was carried by {p['carried_by']}; only the relay can serve it here")


def main() -> int:
    res = Result()
    say(f"scenario {PARAMS['scenario']} on {res.data['uname_r']} {res.data['arch']}, "
        f"{res.data['memory_kib'] // 1024} MiB, {res.data['vcpus']} vCPU")
    try:
        if PARAMS["scenario"] in ("no-nftables", "no-xtables", "cgroup1", "ipvs"):
            kernel_scenario(res)
        elif PARAMS["scenario"] == "edge-256":
            import edge
            edge.run(res)
        elif PARAMS["scenario"] == "arm64":
            import arm64
            arm64.run(res)
        else:
            res.fail(f"unknown scenario {PARAMS['scenario']}")
    except Exception as err:  # the scenario broke: say where, in the result
        res.fail(f"lab error: {type(err).__name__}: {err}")
        res.data["traceback"] = traceback.format_exc()[-3000:]
        res.data["lab_error"] = True
    res.write()
    say(f"{'PASSED' if res.data['passed'] else 'FAILED'}: {res.data['failures'][:5]}")
    return 0 if res.data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
