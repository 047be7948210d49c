"""`explain trace` as a story (usproxy/explain/trace_story.py): the one-line answer per mode, the
walk without repetition and its default length on examples/, a demo pod traced as a pod without
flags, Services without endpoints told truthfully in every mode, and rules quoted as the views
print them."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.explain.conftest import FIXTURES, load
from usproxy.explain import cli, registry, trace, trace_story
from usproxy.explain.mode import Mode
from usproxy.explain.packet import Path as TracePath
from usproxy.model.service_set import Node, load_manifests, service_set

EXAMPLES = Path(__file__).parents[2] / "examples"
DEMO_PODS = ("10.244.1.10", "10.244.2.10", "10.244.3.10", "10.244.4.53")  # endpoints with a nodeName


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().out


def cluster_ips() -> list[str]:
    """Every ClusterIP frontend of examples/ as DST:PORT/PROTO."""
    ss = service_set(load_manifests(EXAMPLES))
    return [f"{fp.cluster_ip}:{fp.sp.port}/{fp.sp.protocol}" for fp in ss.family_ports(4)]


def answers(out: str) -> dict[str, str]:
    """The one-line answers: mode name -> the rest of its line."""
    head = out.split("\n## ")[0]
    return {line.split()[0]: line.split(None, 1)[1] for line in head.splitlines()
            if line and not line.startswith("#") and line.split()[0] in registry.NAMES}


def section(out: str, mode: str) -> str:
    """One mode's walk (its "## " section)."""
    return out[out.index(f"\n## {mode}:") + 1:].split("\n\n")[0]


def demo_paths(mode: Mode, src: str, dst: str) -> list[TracePath]:
    """The paths `mode` traces for the demo pod `src`, on its node node-a (as the CLI does)."""
    ss = service_set(load_manifests(EXAMPLES), Node(name="node-a"))
    pkt = trace.parse_packet(src, dst, ss)
    return mode.trace(ss, replace(pkt, src_pod="its EndpointSlice's nodeName"))


@pytest.mark.parametrize("src", DEMO_PODS)
@pytest.mark.parametrize("dst", cluster_ips())
def test_a_demo_pods_trace_of_a_clusterip_fits_one_screen(src: str, dst: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(["trace", src, dst, "--services", str(EXAMPLES)], capsys)
    assert rc == 0 and len(out.splitlines()) < 60, out
    assert set(answers(out)) == set(registry.NAMES)  # every mode answers, in one line each
    rc, long = run(["trace", src, dst, "--services", str(EXAMPLES), "--detail"], capsys)
    assert rc == 0 and len(long.splitlines()) > len(out.splitlines())


def test_a_demo_pod_is_traced_as_a_pod_without_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """No --cluster-cidr, no --node-name: examples/ says 10.244.1.10 is an endpoint on node-a, so
    the bpf mode shows the socket LB at connect(), not a packet from elsewhere."""
    rc, out = run(["trace", "10.244.1.10", "10.96.10.10:80/TCP", "--services", str(EXAMPLES)], capsys)
    bpf = section(out, "bpf")
    assert rc == 0 and "traced as a pod on node-a" in out
    assert "connect() hook, services map: 10.96.10.10:80/TCP" in bpf
    assert "not on this path" not in bpf and "fallback" not in bpf
    assert "0 rules walked" in answers(out)["bpf"] and "not masqueraded" in answers(out)["bpf"]


def test_the_answers_say_endpoints_masquerade_what_the_backend_sees_and_rules_walked(
        capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = "10.244.1.10", "10.96.10.10:80/TCP"
    rc, out = run(["trace", src, dst, "--services", str(EXAMPLES)], capsys)
    got = answers(out)
    for name in registry.NAMES:
        paths = demo_paths(registry.by_name(name), src, dst)
        rules = sorted({p.rules for p in paths})
        walked = str(rules[0]) if len(rules) == 1 else f"{rules[0]}-{rules[-1]}"
        assert got[name].startswith("to 1 of its 3 endpoints (1/3 each)"), name  # examples/: 3 ready endpoints
        assert f"; {walked} rules walked" in got[name], name
    # the relay opens a connection of its own: the backend sees the node, no NAT involved
    assert ("no NAT in usproxy's relay (kube-proxy 1.0 REDIRECTed to its proxy); the backend sees this node "
            "(the relay's second connection)") in got["userspace"]
    # the kernel modes DNAT and masquerade only a pod reaching itself (kube-proxy's hairpin rule)
    for name in ("iptables", "ipvs", "nftables"):
        assert ("masqueraded only when it lands on 10.244.1.10 itself (hairpin, 1/3); the backend sees "
                "10.244.1.10 or this node") in got[name], name
    # the socket LB rewrites connect(): nothing to masquerade, no rule walked
    assert "not masqueraded; the backend sees 10.244.1.10; 0 rules walked" in got["bpf"]


@pytest.mark.parametrize("proto, legacy", [("TCP", "kube-proxy 1.0 accepted it, then closed it (no endpoint)"),
                                           ("UDP", "kube-proxy 1.0 read the datagram and dropped it (no endpoint)")])
def test_a_service_without_endpoints_is_refused_truthfully_in_every_mode(
        proto: str, legacy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """default/empty in examples/ (TCP), and a UDP twin: no mode claims an endpoint; kube-proxy
    1.0's proxy accepted (read) and closed (dropped), the relay does not listen."""
    services = EXAMPLES
    if proto == "UDP":
        services = tmp_path / "empty-udp.yaml"
        services.write_text((EXAMPLES / "services.yaml").read_text().replace(
            "{port: 80, protocol: TCP, targetPort: 8080}\n", "{port: 80, protocol: UDP, targetPort: 8080}\n"))
    for detail in ([], ["--detail"]):
        rc, out = run(["trace", "10.244.1.10", f"10.96.20.20:80/{proto}", "--services", str(services), *detail], capsys)
        assert rc == 0 and "(no endpoint)" in out.splitlines()[0]
        assert "second connection" not in out and "dnat to" not in out.lower()
        got = answers(out)
        assert all(got[m].startswith("refused") for m in registry.NAMES), got
        assert legacy in got["userspace"]
        assert "refused: connect() fails at once (ECONNREFUSED)" in got["bpf"]
    if proto == "TCP":
        assert "refused at once (a TCP RST)" in got["userspace"]  # nothing listens: the kernel resets
        assert all("refused at once (ICMP port unreachable)" in got[m] for m in ("iptables", "ipvs", "nftables"))


def test_shared_hops_are_printed_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A packet from elsewhere to a NodePort has 3 paths in every mode; what they share (the bpf
    mode's "socket LB: not on this path", the first rules) is said once per mode."""
    rc, out = run(["trace", "203.0.113.7", "192.168.0.2:30080/TCP", "--services", str(FIXTURES / "nodeport.yaml"),
                   "--node-ip", "192.168.0.2"], capsys)
    assert rc == 0 and out.count("socket LB: not on this path") <= 1
    for mode in registry.NAMES:
        lines = section(out, mode).splitlines()
        assert len(lines) == len(set(lines)), mode
    ss = load("nodeport")
    pkt = trace.parse_packet("203.0.113.7", "192.168.0.2:30080/TCP", ss)
    assert all(len(m.trace(ss, pkt)) > 1 for m in registry.MODES)  # there were several paths to fold


def test_rules_in_a_trace_read_as_the_listing_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Every rule a trace quotes (nftables, iptables) is a line of that mode's view."""
    for mode, shape in (("nftables", r"^\s+(?:\[[^\]]+\] )?[^:\s][^:]*? rule \d+(?: \([^)]*\))?: (.*?)(?:  \[goto .*\])?$"),
                        ("iptables", r"^\s+(?:\[[^\]]+\] )?(?:nat|filter) \S+ rule \d+(?: \([^)]*\))?: (.*)$")):
        rc, view = run(["--services", str(EXAMPLES), "--mode", mode, "--node-name", "node-a"], capsys)
        listed = {line.strip() for line in view.splitlines()}
        rc, out = run(["trace", "10.244.1.10", "10.96.10.10:80/TCP", "--services", str(EXAMPLES), "--mode", mode,
                       "--detail"], capsys)
        quoted = [m[1].split("  (then ")[0] for line in out.splitlines()
                  if (m := re.match(shape, line)) and m[1] != "no match"]
        assert rc == 0 and len(quoted) >= 5, mode
        assert [q for q in quoted if q not in listed] == [], mode
    assert "meta mark set meta mark | 0x00004000" in out or "--or-mark" in out


def test_folded_merges_no_match_runs_into_their_neighbours() -> None:
    hops = ["a rules 1-2: no match", "a rule 3: x", "b rule 1: no match", "c rule 1: y", "note"]
    assert trace_story.folded(hops) == [
        "a rule 3 (rules 1-2: no match): x  (then b rule 1: no match)", "c rule 1: y", "note"]


def test_a_pod_in_a_nodes_pod_cidr_is_traced_as_a_pod_there(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A Node object's spec.podCIDRs place a source that is no endpoint; --node-name naming
    another node makes it a packet from elsewhere."""
    node = ("- apiVersion: v1\n  kind: Node\n  metadata: {name: node-b}\n"
            "  spec: {podCIDRs: [10.244.9.0/24]}\n")
    path = tmp_path / "with-node.yaml"
    path.write_text((EXAMPLES / "services.yaml").read_text() + node)
    rc, out = run(["trace", "10.244.9.7", "10.96.10.10:80/TCP", "--services", str(path), "--mode", "bpf"], capsys)
    assert rc == 0 and "inside Node node-b's podCIDR 10.244.9.0/24" in out
    assert "connect() hook" in section(out, "bpf")
    rc, out = run(["trace", "10.244.9.7", "10.96.10.10:80/TCP", "--services", str(path), "--mode", "bpf",
                   "--node-name", "node-a"], capsys)
    assert rc == 0 and "not on this node (--node-name node-a)" in out and "connect() hook" not in out
    rc, out = run(["trace", "10.244.200.1", "10.96.10.10:80/TCP", "--services", str(path), "--mode", "bpf"], capsys)
    assert rc == 0 and "traced as a pod" not in out and "arriving from elsewhere" in out


def test_a_port_no_service_uses_on_a_cluster_ip_is_told_alike_in_summary_and_walk(
        capsys: pytest.CaptureFixture[str]) -> None:
    """IPVS mode: the address is on kube-ipvs0 but no virtual server has the port; filter INPUT's
    KUBE-IPVS-FILTER (before IPVS) rejects the new connection, ICMP port unreachable: the walk
    names that rule and says what the one-line answer says (it said "TCP RST" before)."""
    rc, out = run(["trace", "10.244.9.10", "10.96.10.10:81/tcp", "--services", str(EXAMPLES)], capsys)
    assert rc == 0
    assert "refused at once (ICMP port unreachable)" in answers(out)["ipvs"]
    walk = out.split("## ipvs")[1].split("\n## ")[0]
    assert "filter KUBE-IPVS-FILTER rule" in walk and "-j REJECT" in walk
    assert "KUBE-IPVS-FILTER rejects a new connection (ICMP port unreachable)" in walk and "TCP RST" not in walk
