"""Control-plane measurements.

- usproxy nftables offload: cold programming of N Services × 2 endpoints and one endpoint change
  at that size (p50/p99), timed as `Proxier.sync()` (model, layout diff and the one libnftables
  transaction) into a NftablesDatapath in a throwaway netns, as node-0 of a 50-node cluster (the
  endpoints' nodeNames are spread over 50 nodes, so most get no hairpin element).
- The reference in the same run: kube-proxy's nftables layout (per Service a chain with an
  anonymous `numgen random mod N vmap`, per endpoint a chain with its dnat, the service-ips
  verdict map) loaded with `nft -f` into another throwaway netns; one change = what kube-proxy
  rewrites for it (new endpoint chain, flushed service chain, deleted old endpoint chain).
- The relay: first sync of an agent started with N Services (ClusterIPs on the VIP interface,
  one listener each) from the agent's own sync-duration histogram, and one change at that size.
- Edit → first connection: an agent serves Service "edit"; its EndpointSlice is rewritten from
  one server pod to the other, and a client polling the ClusterIP every 2 ms reports when the
  new pod first answers.
bench/nft_scale.py's `run_size()` (the datapath's apply() alone, without the Proxier) runs beside.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from bench.contenders import Agent, Ctx, service_manifest, write_manifests
from bench.procs import PYTHON
from bench.topology import SERVER2_IP, SERVER_IP
from tests.netns import nsexec, sh

Log = Callable[[str], None]


def cluster_ip(i: int) -> str:
    return f"10.96.{128 + i // 250}.{i % 250 + 1}"


def endpoint_ip(i: int, k: int) -> str:
    return f"10.244.{100 + (2 * i + k) // 250}.{(2 * i + k) % 250 + 1}"


def services(n: int, first: int = 0) -> list[dict[str, Any]]:
    """n Services (one TCP port each) with 2 ready endpoints, as kubectl prints them."""
    out: list[dict[str, Any]] = []
    for i in range(first, first + n):
        name = f"s{i}"
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "scale"},
                    "spec": {"clusterIP": cluster_ip(i), "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                                                   "protocol": "TCP"}]}})
        out.append(endpoint_slice(name, [endpoint_ip(i, 0), endpoint_ip(i, 1)]))
    return out


NODES = 50  # the endpoints' nodeNames are spread over this many nodes; the agent measured is node-0


def node_of(ip: str) -> str:
    return f"node-{int(ipaddress.ip_address(ip)) % NODES}"


def endpoint_slice(name: str, ips: list[str]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{name}-1", "namespace": "scale", "labels": {"kubernetes.io/service-name": name}},
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": node_of(ip)} for ip in ips]}


def pcts(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    if not s:
        return {}
    return {"p50": statistics.median(s), "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))],
            "max": s[-1], "n": len(s)}


class ScratchNetns:
    """A throwaway netns for nft programming; deleted (with its tables) on exit."""

    def __init__(self, tag: str) -> None:
        self.name = f"benchcp{secrets.token_hex(3)}-{tag}"

    def __enter__(self) -> str:
        sh("ip", "netns", "add", self.name)
        return self.name

    def __exit__(self, *exc: object) -> None:
        sh("ip", "netns", "del", self.name, check=False)


# -- usproxy nftables offload ------------------------------------------------------------------------
class _NftSink:
    """A Datapath that hands each sync's changes to a NftablesDatapath (one transaction)."""

    name = "nftables"

    def __init__(self, nft: Any) -> None:
        self.nft = nft
        self.apply_seconds = 0.0

    async def sync(self, request: Any) -> None:
        t = time.perf_counter()
        await self.nft.apply(request.changes)
        self.apply_seconds = time.perf_counter() - t

    def placement(self, spn: Any) -> None:
        return None

    def dump(self) -> str:
        return ""

    async def close(self) -> None:
        pass


async def _usproxy_nft(ns: str, n: int, changes: int) -> dict[str, Any]:
    from usproxy.model.manifest import objects_from
    from usproxy.model.node import NodeFacts
    from usproxy.offload.nftables.datapath import NftablesDatapath
    from usproxy.core.proxier import Proxier

    from usproxy.offload.nftables.rules import _TEXT

    _TEXT.clear()  # the address-text cache starts empty in a starting agent too
    nft = NftablesDatapath(netns=ns, lb_policy="random", node=NodeFacts("node-0"))
    nft.probe()  # as the agent: capabilities are probed (libnftables loaded) before the first sync
    sink = _NftSink(nft)
    proxier = Proxier([sink], node=NodeFacts("node-0"))
    m = objects_from(list[Mapping[str, Any]](services(n)))
    t_parse = time.perf_counter()
    for svc in m.services.values():
        proxier.on_service_update(None, svc)
    for sl in m.slices.values():
        proxier.on_endpoint_slice_update(None, sl)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    t0 = time.perf_counter()
    await proxier.sync()
    cold = time.perf_counter() - t0
    cold_apply = sink.apply_seconds
    one: list[float] = []
    one_apply: list[float] = []
    slices = dict(m.slices)
    for k in range(changes):
        i = (k * 7919) % n
        key = next(x for x in slices if x.name == f"s{i}-1")
        new = objects_from(list[Mapping[str, Any]]([endpoint_slice(f"s{i}", [endpoint_ip(i, 0), f"10.245.{k // 250}.{k % 250 + 1}"])])).slices
        (nsl,) = new.values()
        proxier.on_endpoint_slice_update(slices[key], nsl)
        slices[key] = nsl
        t = time.perf_counter()
        await proxier.sync()
        one.append(time.perf_counter() - t)
        one_apply.append(sink.apply_seconds)
    nft.close()
    return {"services": n, "cold_s": cold, "cold_nft_transaction_s": cold_apply, "model_feed_s": t0 - t_parse,
            "one_change_s": pcts(one), "one_change_nft_transaction_s": pcts(one_apply)}


def usproxy_nft(n: int, changes: int, rounds: int = 3) -> dict[str, Any]:
    """Cold: the median of `rounds` cold syncs, each in a fresh namespace (this VM's timings vary
    by a fifth from run to run); one change: measured after the last."""
    colds: list[float] = []
    for r in range(rounds):
        with ScratchNetns("us") as ns:
            res = asyncio.run(_usproxy_nft(ns, n, changes if r == rounds - 1 else 0))
        colds.append(res["cold_s"])
    return {**res, "cold_s": statistics.median(colds), "cold_runs_s": colds}


# -- kube-proxy's nftables layout (reference) ---------------------------------------------------------
def _kp_names(i: int, k: int, ep: str) -> tuple[str, str]:
    """kube-proxy's chain names: service-<hash>-<ns>/<name>/<proto>/<port> and endpoint-<hash>-..."""
    return f"service-{i:08x}-scale/s{i}/tcp/http", f"endpoint-{i:08x}-{k}-{ep}-scale/s{i}/tcp/http"


def _kp_endpoint(i: int, k: int, ep: str) -> list[str]:
    ec = _kp_names(i, k, ep)[1]
    return [f"add chain ip kube-proxy {ec}",
            f"add rule ip kube-proxy {ec} ip saddr {ep} jump mark-for-masquerade",
            f"add rule ip kube-proxy {ec} meta l4proto tcp dnat to {ep}:8080"]


def _kp_service_rules(i: int, eps: list[str]) -> list[str]:
    chain = _kp_names(i, 0, eps[0])[0]
    vmap = ", ".join(f"{k} : goto {_kp_names(i, k, ep)[1]}" for k, ep in enumerate(eps))
    return [f"add rule ip kube-proxy {chain} ip daddr {cluster_ip(i)} tcp dport 80 ip saddr != 10.244.0.0/16 "
            "jump mark-for-masquerade",
            f"add rule ip kube-proxy {chain} numgen random mod {len(eps)} vmap {{ {vmap} }}"]


def _kp_service(i: int, eps: list[str]) -> list[str]:
    chain = _kp_names(i, 0, eps[0])[0]
    out = [f"add chain ip kube-proxy {chain}"]
    for k, ep in enumerate(eps):
        out += _kp_endpoint(i, k, ep)
    out += _kp_service_rules(i, eps)
    out.append(f"add element ip kube-proxy service-ips {{ {cluster_ip(i)} . tcp . 80 : goto {chain} }}")
    return out


def kube_proxy_ruleset(n: int) -> str:
    lines = ["add table ip kube-proxy",
             "add chain ip kube-proxy mark-for-masquerade",
             "add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000",
             "add chain ip kube-proxy services",
             "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
             "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority dstnat ; }",
             "add rule ip kube-proxy nat-prerouting jump services",
             "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips"]
    for i in range(n):
        lines += _kp_service(i, [endpoint_ip(i, 0), endpoint_ip(i, 1)])
    return "\n".join(lines) + "\n"


def _kp_change(i: int, k: int) -> str:
    """Replace endpoint 1 of Service i as kube-proxy does: a new endpoint chain, the service chain
    flushed and rewritten with a new anonymous vmap, the old endpoint chain deleted."""
    old_ep = endpoint_ip(i, 1) if k == 0 else f"10.245.{(k - 1) // 250}.{(k - 1) % 250 + 1}"
    new_ep = f"10.245.{k // 250}.{k % 250 + 1}"
    chain = _kp_names(i, 0, new_ep)[0]
    lines = _kp_endpoint(i, 1, new_ep) + [f"flush chain ip kube-proxy {chain}"]
    lines += _kp_service_rules(i, [endpoint_ip(i, 0), new_ep])
    lines.append(f"delete chain ip kube-proxy {_kp_names(i, 1, old_ep)[1]}")
    return "\n".join(lines) + "\n"


def kube_proxy_nft(n: int, changes: int, work: Path) -> dict[str, Any]:
    path = work / f"kube-proxy-{n}.nft"
    path.write_text(kube_proxy_ruleset(n))
    with ScratchNetns("kp") as ns:
        t = time.perf_counter()
        r = nsexec(ns, "nft", "-f", str(path), check=False)
        cold = time.perf_counter() - t
        if r.returncode != 0:
            return {"services": n, "error": r.stderr.strip()[:300]}
        one = []
        i = n // 2
        for k in range(changes):
            p = work / "kp-change.nft"
            # one service, changed again and again (each change replaces its second endpoint)
            p.write_text(_kp_change(i, k))
            t = time.perf_counter()
            r = nsexec(ns, "nft", "-f", str(p), check=False)
            one.append(time.perf_counter() - t)
            if r.returncode != 0:
                return {"services": n, "cold_s": cold, "error": "change: " + r.stderr.strip()[:300]}
    path.unlink()
    return {"services": n, "cold_s": cold, "one_change_s": pcts(one)}


# -- the relay at scale -------------------------------------------------------------------------------
def _sync_stats(agent: Agent) -> tuple[float, int]:
    text = agent.get(agent.metrics, "/metrics")
    s = float(re.search(r"^kubeproxy_sync_proxy_rules_duration_seconds_sum (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    c = int(float(re.search(r"^kubeproxy_sync_proxy_rules_duration_seconds_count (\S+)", text, re.M).group(1)))  # type: ignore[union-attr]
    return s, c


def relay_scale(ctx: Ctx, n: int, changes: int, index: int) -> dict[str, Any]:
    agent = Agent(ctx, f"scale{n}", index, "none")
    agent.dir.mkdir(parents=True, exist_ok=True)
    # the Services that change live in their own small file: the static source re-reads only it
    write_manifests_file(agent.dir / "bulk.yaml", services(n - 5, 5))
    slices = {i: [endpoint_ip(i, 0), endpoint_ip(i, 1)] for i in range(5)}
    try:
        startup = agent.start(services(5))
        s0, c0 = _sync_stats(agent)
        cold = s0  # the first (full) sync's duration; later syncs are counted below
        one = []
        for k in range(changes):
            i = k % 5
            slices[i] = [endpoint_ip(i, 0), f"10.245.{k // 250}.{k % 250 + 1}"]
            objs = []
            for j in range(5):
                objs += [o for o in services(1, j) if o["kind"] == "Service"] + [endpoint_slice(f"s{j}", slices[j])]
            write_manifests(agent.dir, objs)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s1, c1 = _sync_stats(agent)
                if c1 > c0:
                    one.append((s1 - s0) / (c1 - c0))
                    s0, c0 = s1, c1
                    break
                time.sleep(0.02)
        return {"services": n, "cold_first_sync_s": cold, "spawn_to_synced_s": startup,
                "one_change_sync_s": pcts(one)}
    finally:
        agent.stop()


def write_manifests_file(path: Path, objects: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, sort_keys=False))
    os.rename(tmp, path)


# -- edit → first connection ------------------------------------------------------------------------
EDIT_IP = "10.96.110.10"


def edit_to_connection(ctx: Ctx, offload: str, repeats: int, index: int, background: int = 0) -> dict[str, Any]:
    label = f"edit-{offload}-{background}"
    extra = ["--offload-after", "1"] if offload != "none" else []
    agent = Agent(ctx, label, index, offload, extra)
    if background:
        write_manifests_file(agent.dir / "bulk.yaml", services(background, 5))
    pods = [("srv", SERVER_IP), ("srv2", SERVER2_IP)]
    try:
        agent.start(service_manifest("edit", EDIT_IP, SERVER_IP, udp=False))
        if offload != "none":
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                rows = [r for r in agent.services() if "edit" in r["servicePortName"]]
                if rows and all(r["datapath"] == offload for r in rows):
                    break
                time.sleep(0.2)
            else:
                return {"error": f"edit Service not offloaded to {offload}"}
        times = []
        for k in range(repeats):
            name, ip = pods[(k + 1) % 2]
            p = ctx.procs.spawn(ctx.topo.client, [PYTHON, "-m", "bench.clients",
                                                  json.dumps({"op": "until", "target": EDIT_IP, "name": name, "timeout": 20})],
                                stdout=subprocess.PIPE)
            assert p.stdout is not None
            p.stdout.readline()  # polling has started
            time.sleep(0.05)
            t_edit = write_manifests(agent.dir, service_manifest("edit", EDIT_IP, ip, udp=False))
            out = p.stdout.read().decode()
            ctx.procs.stop(p)
            r = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
            if r["t"] is not None:
                times.append(r["t"] - t_edit)
            time.sleep(0.3)
        return {"offload": offload, "background_services": background, **pcts(times), "samples": times}
    finally:
        agent.stop()


# -- the phase --------------------------------------------------------------------------------------
def measure(ctx: Ctx, sizes: tuple[int, ...], changes: int, kp_changes: int, edit_repeats: int,
            relay_sizes: tuple[int, ...], log: Log) -> dict[str, Any]:
    out: dict[str, Any] = {"usproxy_nftables": [], "kube_proxy_nftables": [], "relay": [], "edit_to_connection": []}
    ext = _external(sizes, changes, log)
    if ext is not None:
        out["nft_scale"] = ext
    for n in sizes:
        r = usproxy_nft(n, changes)
        out["usproxy_nftables"].append(r)
        log(f"  usproxy nftables {n}: cold {r['cold_s']:.3f}s, one change p50 {r['one_change_s']['p50'] * 1e3:.2f} ms "
            f"p99 {r['one_change_s']['p99'] * 1e3:.2f} ms")
        k = kube_proxy_nft(n, kp_changes, ctx.work)
        out["kube_proxy_nftables"].append(k)
        log(f"  kube-proxy layout {n}: {k.get('cold_s', float('nan')):.2f}s {k.get('error', '')}")
    for n in relay_sizes:
        r = relay_scale(ctx, n, changes, 5)
        out["relay"].append(r)
        log(f"  relay {n}: first sync {r['cold_first_sync_s']:.2f}s, one change p50 "
            f"{r['one_change_sync_s'].get('p50', float('nan')) * 1e3:.2f} ms")
    for offload in ("none", "nftables"):
        r = edit_to_connection(ctx, offload, edit_repeats, 6 if offload == "none" else 7)
        out["edit_to_connection"].append(r)
        log(f"  edit → first connection ({offload}): p50 {r.get('p50', float('nan')) * 1e3:.0f} ms "
            f"max {r.get('max', float('nan')) * 1e3:.0f} ms {r.get('error', '')}")
    return out


def _external(sizes: tuple[int, ...], changes: int, log: Log) -> Any:
    """bench/nft_scale.py's run_size(ns, n, changes): NftablesDatapath.apply() alone (no Proxier)."""
    if not (Path(__file__).with_name("nft_scale.py")).exists():
        return None
    try:
        import importlib

        mod = importlib.import_module("bench.nft_scale")
        fn = getattr(mod, "run_size", None)
        if fn is None:
            log("  bench/nft_scale.py exposes no run_size(ns, n, changes); not included")
            return None
        rows = []
        for nodes in (1, NODES):
            for n in sizes:
                with ScratchNetns("ns") as ns:
                    rows.append(asyncio.run(fn(ns, n, changes, nodes, 3)))
                log(f"  nft_scale (datapath alone) {n}, endpoints over {nodes} node(s): cold {rows[-1]['cold_s']:.3f}s, "
                    f"one change p50 {rows[-1]['one_change_p50_ms']:.2f} ms p99 {rows[-1]['one_change_p99_ms']:.2f} ms")
        return rows
    except Exception as err:  # another engineer's module: report, never fail the run
        log(f"  bench/nft_scale.py failed: {err}")
        return {"error": str(err)}


__all__ = ["measure", "usproxy_nft", "kube_proxy_nft"]
