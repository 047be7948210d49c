"""`usproxy explain --scale N` and the "why, in numbers" rows it shares with `explain`: numbers
measured by the renderers and tracers, equal to rendering a real manifest of the same Services;
iptables' walk grows by one rule per Service (KUBE-SERVICES is a list), nftables' and BPF's do
not (verdict maps, hash maps); the IPVS row is the IPVS trace's count."""

from __future__ import annotations

import ipaddress
from fractions import Fraction
from pathlib import Path

import pytest

from usproxy.explain import cli, cost, diff, generator, registry, scale
from usproxy.explain.ipvs_trace import trace_ipvs
from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set

# One Service, one port, two ready endpoints on two nodes.
TEMPLATE = """apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {namespace: shop, name: web}
  spec:
    clusterIP: 10.96.1.1
    ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {namespace: shop, name: web-a, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.5], nodeName: node-a}
  - {addresses: [10.244.2.7], nodeName: node-b}
"""
NODE = Node(name="node-a")

IPTABLES = registry.by_name("iptables")


def _service_yaml(i: int, width: int, extra: str | None = None) -> str:
    """Generated Service i as a manifest, written by hand: the addresses the generator gives it
    (ClusterIP 10.96.0.i, endpoints 10.244.0.2i-1 on node-a and 10.244.0.2i on node-b)."""
    name = f"svc-{i:0{width}d}"
    eps = [f"  - {{addresses: [10.244.0.{2 * i - 1}], nodeName: node-a}}",
           f"  - {{addresses: [10.244.0.{2 * i}], nodeName: node-b}}"]
    if extra:
        eps.append(f"  - {{addresses: [{extra}], nodeName: node-a}}")
    return "\n".join([
        "- apiVersion: v1", "  kind: Service", f"  metadata: {{namespace: scale, name: {name}}}",
        f"  spec: {{clusterIP: 10.96.0.{i}, ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]}}",
        "- apiVersion: discovery.k8s.io/v1", "  kind: EndpointSlice",
        f"  metadata: {{namespace: scale, name: {name}-a, labels: {{kubernetes.io/service-name: {name}}}}}",
        "  addressType: IPv4", "  ports: [{name: http, port: 8080, protocol: TCP}]", "  endpoints:", *eps])


def _manifest(tmp_path: Path, n: int, grown: bool) -> Path:
    """N generated Services as a real manifest file; `grown`: with the endpoint the change adds
    (the next pod address, on the node of the last Service's first endpoint)."""
    width = len(str(n))
    docs = [_service_yaml(i, width, f"10.244.0.{2 * n + 1}" if grown and i == n else None)
            for i in range(1, n + 1)]
    path = tmp_path / f"{n}-{'new' if grown else 'old'}.yaml"
    path.write_text("apiVersion: v1\nkind: List\nitems:\n" + "\n".join(docs) + "\n")
    return path


@pytest.fixture
def template(tmp_path: Path) -> ServiceSet:
    path = tmp_path / "template.yaml"
    path.write_text(TEMPLATE)
    return service_set(load_manifests(path), NODE)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_small_n_equals_rendering_a_real_generated_manifest(template: ServiceSet, tmp_path: Path, n: int) -> None:
    old = service_set(load_manifests(_manifest(tmp_path, n, grown=False)), NODE)
    new = service_set(load_manifests(_manifest(tmp_path, n, grown=True)), NODE)
    generated = generator.generate(template, n)
    assert generated.ports == old.ports
    fp = scale.last_port(generated)
    assert generator.with_endpoint_added(generated, fp.name).ports == new.ports
    (file_fp,) = (f for f in old.family_ports(4) if str(f.cluster_ip) == f"10.96.0.{n}")
    for mode in registry.MODES:
        m = scale.measure(generated, mode, cli._dump_view)
        rules, worst, lookups = cost.first_packet_of(old, file_fp, mode)
        _, added, removed = diff.unified(scale.unpadded(cli._dump_view(old, mode)),
                                         scale.unpadded(cli._dump_view(new, mode)), mode.name)
        assert (m.rules, m.worst, m.lookups, m.added, m.removed) == (rules, worst, lookups, added, removed), mode
        assert m.sends == mode.sends(old, new)
    assert scale.measure(generated, IPTABLES, cli._dump_view).sends == \
        f"{diff.iptables_sends(old, new)} lines of iptables-restore (partial sync)"


def test_iptables_hand_count_for_one_and_two_services(template: ServiceSet) -> None:
    # N=1, path to the first endpoint: nat PREROUTING's jump, KUBE-SERVICES rule 1 (the
    # ClusterIP), KUBE-SVC rule 1 (probability 0.5), KUBE-SEP rule 1 (-s the endpoint: no match),
    # KUBE-SEP rule 2 (DNAT), nat POSTROUTING's jump, KUBE-POSTROUTING rule 1 (no mark: RETURN):
    # 7. To the second endpoint KUBE-SVC rule 1 misses and rule 2 jumps: 8. Mean 15/2.
    # N=2: the last Service is KUBE-SERVICES rule 2, so rule 1 is walked too: 8 and 9.
    one = scale.measure(generator.generate(template, 1), IPTABLES, cli._dump_view)
    two = scale.measure(generator.generate(template, 2), IPTABLES, cli._dump_view)
    assert (one.rules, one.worst) == (Fraction(15, 2), 8)
    assert (two.rules, two.worst) == (Fraction(17, 2), 9)


def test_iptables_walk_grows_linearly_nftables_and_bpf_stay_constant(template: ServiceSet) -> None:
    sizes = (1, 10, 100, 400)
    got = {n: {m: scale.measure(generator.generate(template, n), registry.by_name(m), cli._dump_view)
               for m in ("iptables", "nftables", "bpf")} for n in sizes}
    for n in sizes:  # one KUBE-SERVICES rule more per Service before the last one's
        assert got[n]["iptables"].rules == got[1]["iptables"].rules + (n - 1)
        assert got[n]["iptables"].worst == got[1]["iptables"].worst + (n - 1)
        for mode in ("nftables", "bpf"):
            m, first = got[n][mode], got[1][mode]
            assert (m.rules, m.worst, m.lookups) == (first.rules, first.worst, first.lookups), (mode, n)
            assert m.sends == first.sends, (mode, n)
    assert got[1]["bpf"].rules == 0 and got[1]["nftables"].rules > 0


def test_scale_cli_prints_a_row_per_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "template.yaml"
    path.write_text(TEMPLATE)
    assert cli.main(["--services", str(path), "--scale", "50", "--node-name", "node-a"]) == 0
    out = capsys.readouterr().out
    assert "at 50 Services generated like the input's 1 Service (" in out
    assert "scale/svc-50:http at 10.96.0.50:80/TCP" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in registry.NAMES}
    assert list(rows) == list(registry.NAMES)
    assert rows["iptables"].split()[1:5] == ["56.5", "(worst", "57)", "0"]  # 7.5 + 49 KUBE-SERVICES rules
    # The added endpoint goes to the node of svc-50's first endpoint, 10.244.0.100 on node-b: not
    # this node, so KUBE-LOOP-BACK gains no entry.
    assert "1 real server, 0 ipset entries" in rows["ipvs"]
    # Slots follow the endpoints' "ip:port" order: the added 10.244.0.101:8080 sorts between
    # svc-50's 10.244.0.100:8080 and 10.244.0.99:8080, so slot 3 is new and slot 2 rewritten.
    assert "4 map elements (1 backend, 2 slots, 1 slot-0 count)" in rows["bpf"]


def test_scale_mode_shows_only_that_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "template.yaml"
    path.write_text(TEMPLATE)
    assert cli.main(["--services", str(path), "--scale", "3", "--mode", "nftables"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in registry.NAMES] \
        == ["nftables"]


@pytest.mark.parametrize("bad", ["0", "60001", "many"])
def test_scale_out_of_range_is_a_usage_error(bad: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--services", "x", "--scale", bad])
    assert exc.value.code == 2


def test_ipvs_row_is_the_ipvs_traces_count(template: ServiceSet) -> None:
    row = cost.render(template, (registry.by_name("ipvs"),))
    pkt = cost.pod_packet(template, template.family_ports(4)[0])
    paths = trace_ipvs(template, pkt)
    rules = sum(p.share * p.rules for p in paths)
    lookups = sum(p.share * p.lookups for p in paths)
    assert f"{float(rules):.1f} iptables rules (worst {max(p.rules for p in paths)}), " \
           f"{float(lookups):.1f} lookups" in row
    assert rules > 2  # more than the 2 rules the row used to state as fixed text
    assert "1 real server, 1 ipset entry" in row  # the added endpoint is local: KUBE-LOOP-BACK


def test_ipvs_and_bpf_change_read_off_the_views(template: ServiceSet) -> None:
    # An endpoint on this node (node-a) added to a ClusterIP Service: one real server and its
    # KUBE-LOOP-BACK entry (hairpin, local endpoints only); a BPF backend, its slot and the
    # ClusterIP frontend's count.
    fp = template.family_ports(4)[0]
    grown = generator.with_endpoint_added(template, fp.name)
    assert [str(ep) for _, eps in grown.ports for ep in eps] == [
        "10.244.1.5:8080", "10.244.2.7:8080", "10.244.2.8:8080"]
    assert cost.ipvs_writes(template, grown) == (1, 1)
    assert cost.bpf_writes(template, grown) == (1, 1, 1)


def test_generated_addresses_are_unique_and_in_the_pools(template: ServiceSet) -> None:
    big = generator.generate(template, 300)
    ips = [sp.cluster_ip for sp, _ in big.ports]
    pods = [ep.ip for _, eps in big.ports for ep in eps]
    assert len(set(ips)) == 300 and len(set(pods)) == 600
    assert all(ip in ipaddress.ip_network("10.96.0.0/16") for ip in ips)
    assert all(ip in ipaddress.ip_network("10.244.0.0/16") for ip in pods)
