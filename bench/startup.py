"""The control plane end to end, as a user meets it (issue 30 items 1, 2 and 4).

    sudo .venv/bin/python -m bench.startup [--sizes 1000,5000,10000] [--rounds 3] [--changes 20]

- **Cold start**: `usproxy run --offload nftables --offload-after 0` spawned in a fresh network
  namespace, from the spawn to the end of its first sync (/healthz `lastUpdated`), which with
  `--offload-after 0` is when every ServicePort is in the nftables datapath (checked after, from
  /metrics `usproxy_service_ports{datapath="nftables"}`). Static mode: one manifest file as
  `kubectl get svc,endpointslices -A -o yaml` prints it (a `List` with creationTimestamp and
  resourceVersion: 9.6 MB at 10,000 Services × 2 endpoints). Kubernetes mode: the stand-in API server (bench/fake_api.py, a
  process of its own) serving the same objects; the agent lists and watches it. Agent CPU
  (utime+stime) and RSS (after the sync; VmHWM the peak) from /proc. Median of `rounds`.
- **One change**: the same agent in the bench topology, the file also holding Service "edit"
  (ClusterIP EDIT_IP) whose one endpoint is rewritten from one server pod to the other: in the
  single file (rewritten whole and renamed in, as an editor or `kubectl get > f; mv` does), or
  as an EndpointSlice update on the API server (one watch event). Timed from the rename (the
  API call) to the first connection a client polling the ClusterIP every 2 ms makes to the new
  pod, through the kernel's DNAT; agent CPU over the same window. Changes are 1.2 s apart (the
  sync runner's default --min-sync-period is 1 s, kube-proxy's).
- **Kernel step** (bench/controlplane.py `usproxy_nft`): `Proxier.sync()` into the nftables
  datapath in-process, cold, the model already fed: what the README's earlier table measured.
- **kube-proxy**: its nftables layout for the same Services (bench/controlplane.py
  `kube_proxy_ruleset`) fed to `nft -f -` on stdin, as kube-proxy's knftables runs it, into an
  empty namespace; one change = the transaction kube-proxy sends for an endpoint change. This is
  what kube-proxy's own kernel step costs on this machine; its Go model and API client cost more.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.controlplane import EDIT_IP, ScratchNetns, _kp_change, cluster_ip, endpoint_ip, kube_proxy_ruleset, node_of, pcts, usproxy_nft
from bench.procs import PYTHON, ROOT, Procs, cpu_seconds
from bench.servers import CONN
from bench.topology import SERVER2_IP, SERVER_IP, BenchTopology, inside
from tests.netns import nsexec, sh
from tests.sources.fake_apiserver import kubeconfig_text
from usproxy.tour.manifests import kubectl_yaml

USPROXY = str(ROOT / ".venv" / "bin" / "usproxy")
HEALTHZ, METRICS = "127.0.0.1:10256", "127.0.0.1:10249"
CHANGE_GAP = 1.2  # seconds between two changes: above the default --min-sync-period (1 s)
Log = Any


# -- objects, as the API server holds them and kubectl prints them ------------------------------------
def _meta(name: str, i: int, **extra: Any) -> dict[str, Any]:
    return {"creationTimestamp": "2026-12-01T00:00:00Z", "name": name, "namespace": "scale",
            "resourceVersion": str(1000 + i), **extra}


def service(name: str, i: int, ip: str, port: int = 80, target: int = 8080) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, i),
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"name": "http", "port": port, "protocol": "TCP",
                                                                     "targetPort": target}],
                     "sessionAffinity": "None", "type": "ClusterIP"}}


def endpoint_slice(name: str, i: int, ips: list[str], port: int = 8080) -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": name}
    return {"addressType": "IPv4", "apiVersion": "discovery.k8s.io/v1",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                           "nodeName": node_of(ip)}
                          for ip in ips],
            "kind": "EndpointSlice", "metadata": _meta(f"{name}-x7k2p", i, labels=labels),
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}


def edit_objects(endpoint: str) -> list[dict[str, Any]]:
    """Service "edit" on CONN, one endpoint: a bench server pod."""
    return [service("edit", 10**6, EDIT_IP, CONN, CONN), endpoint_slice("edit", 10**6, [endpoint], CONN)]


def scale_objects(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [service(f"s{i}", i, cluster_ip(i)), endpoint_slice(f"s{i}", i, [endpoint_ip(i, 0), endpoint_ip(i, 1)])]
    return out


# -- one agent ---------------------------------------------------------------------------------------
class Spawned:
    """`usproxy run` in netns `ns` with admin on HEALTHZ/METRICS of that namespace."""

    def __init__(self, procs: Procs, ns: str, args: list[str], log: Path) -> None:
        self.procs, self.ns = procs, ns
        argv = [USPROXY, "run", "--offload", "nftables", "--offload-after", "0",
                "--healthz-bind-address", HEALTHZ, "--metrics-bind-address", METRICS, *args]
        self.t0 = time.monotonic()
        self.proc = procs.spawn(ns, argv, log=log, env=dict(os.environ, USPROXY_EVENT_LOOP="uvloop"))
        self.log = log

    def get(self, addr: str, path: str) -> bytes:
        with inside(self.ns):
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=30) as r:
                return bytes(r.read())

    def wait_synced(self, timeout: float = 300.0) -> float:
        """Seconds from the spawn to the end of the first sync."""
        while time.monotonic() < self.t0 + timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}: {self.log.read_text()[-1500:]}")
            try:
                if not json.loads(self.get(HEALTHZ, "/healthz"))["lastUpdated"].startswith("0001-"):
                    return time.monotonic() - self.t0
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.02)  # each poll costs the agent an HTTP request: not more often
        raise RuntimeError(f"agent did not sync within {timeout}s")

    def placed(self) -> dict[str, float]:
        text = self.get(METRICS, "/metrics").decode()
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^usproxy_service_ports\{datapath="([^"]+)"\} (\S+)$', text, re.M)}

    def memory(self) -> dict[str, float]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return {k: int(re.search(rf"^{k}:\s+(\d+)", status, re.M).group(1)) / 1024  # type: ignore[union-attr]
                for k in ("VmRSS", "VmHWM")}

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.procs.stop(self.proc, timeout=30.0)


class ApiServer:
    """bench/fake_api.py in netns `ns`, serving `objects`."""

    def __init__(self, procs: Procs, ns: str, objects: list[dict[str, Any]], work: Path) -> None:
        path = work / "api-objects.json"
        path.write_text(json.dumps({"services": [o for o in objects if o["kind"] == "Service"],
                                    "endpointslices": [o for o in objects if o["kind"] == "EndpointSlice"]}))
        self.procs = procs
        self.proc = procs.spawn(ns, [PYTHON, "-m", "bench.fake_api", str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().split()
        if line[:1] != ["ready"]:
            raise RuntimeError(f"fake API server: {line}")
        self.kubeconfig = work / "kubeconfig"
        self.kubeconfig.write_text(kubeconfig_text(line[1]))

    def apply(self, resource: str, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"apply {resource} {json.dumps(obj)}\n".encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.procs.stop(self.proc)


def _agent_args(mode: str, manifest: Path, api: ApiServer | None, vip: str) -> list[str]:
    if mode == "static":
        return ["--services", str(manifest), "--vip-interface", vip]
    assert api is not None
    return ["--kubeconfig", str(api.kubeconfig), "--hostname-override", "node-0", "--vip-interface", vip]


# -- cold start --------------------------------------------------------------------------------------
def wait_listening(ns: str, count: int, t0: float, timeout: float = 120.0) -> float | None:
    """Seconds from `t0` until `count` TCP sockets listen in `ns` (None: not within `timeout`)."""
    while time.monotonic() < t0 + timeout:
        out = nsexec(ns, "ss", "-Hltn", check=False).stdout
        if out.count("\n") >= count:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def cold(procs: Procs, mode: str, n: int, work: Path) -> dict[str, Any]:
    """One cold start in a fresh namespace."""
    objects = scale_objects(n)
    manifest = work / f"scale-{n}.yaml"
    if mode == "static" and not manifest.exists():
        manifest.write_text(kubectl_yaml(objects))
    with ScratchNetns("st" if mode == "static" else "kb") as ns:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        api = ApiServer(procs, ns, objects, work) if mode == "kubernetes" else None
        load = os.getloadavg()[0]
        agent = Spawned(procs, ns, _agent_args(mode, manifest, api, "usproxy0"), work / f"cold-{mode}-{n}.log")
        try:
            seconds = agent.wait_synced()
            out: dict[str, Any] = {"services": n, "mode": mode, "spawn_to_kernel_s": seconds, "cpu_s": agent.cpu(), **agent.memory(),
                   "load1": load, "manifest_mb": manifest.stat().st_size / 1e6 if mode == "static" else None}
            # the relay's listeners open after the kernel step (the fallback): when all are open
            extra = 3 if mode == "kubernetes" else 2  # the admin ports, the API server
            out["spawn_to_listeners_s"] = wait_listening(ns, n + extra, agent.t0)
            out["cpu_listeners_s"] = agent.cpu()
            out["rss_settled"] = agent.memory()["VmRSS"]
            out["placed"] = agent.placed()
        finally:
            agent.stop()
            if api is not None:
                api.stop()
    if out["placed"].get("nftables") != n:
        out["error"] = f"not every ServicePort in nftables: {out['placed']}"
    return out


# -- one change --------------------------------------------------------------------------------------
def changes(procs: Procs, topo: BenchTopology, mode: str, n: int, count: int, work: Path) -> dict[str, Any]:
    """`count` changes of Service "edit"'s endpoint among n Services, each timed to the first
    connection through the kernel to the new pod; the agent's CPU over each."""
    bulk = scale_objects(n)
    half = len(bulk) // 2

    def objects(endpoint: str) -> list[dict[str, Any]]:
        return bulk[:half] + edit_objects(endpoint) + bulk[half:]
    manifest = work / f"change-{n}.yaml"
    api = None
    if mode == "static":
        manifest.write_text(kubectl_yaml(objects(SERVER_IP)))
    else:
        api = ApiServer(procs, topo.node, objects(SERVER_IP), work)
    agent = Spawned(procs, topo.node, _agent_args(mode, manifest, api, "usproxy8"), work / f"change-{mode}-{n}.log")
    times, cpus, loads = [], [], []
    try:
        agent.wait_synced()
        texts = {ip: kubectl_yaml(objects(ip)) for ip in (SERVER_IP, SERVER2_IP)} if mode == "static" else {}
        for k in range(count):
            name, ip = (("srv2", SERVER2_IP), ("srv", SERVER_IP))[k % 2]
            client = procs.spawn(topo.client, [PYTHON, "-m", "bench.clients", json.dumps(
                {"op": "until", "target": EDIT_IP, "name": name, "timeout": 20})], stdout=subprocess.PIPE)
            assert client.stdout is not None
            client.stdout.readline()  # polling has started
            time.sleep(0.05)
            loads.append(os.getloadavg()[0])
            cpu0 = agent.cpu()
            if mode == "static":
                tmp = manifest.with_name("." + manifest.name + ".tmp")
                tmp.write_text(texts[ip])
                t_edit = time.monotonic()
                os.rename(tmp, manifest)
            else:
                assert api is not None
                t_edit = time.monotonic()
                api.apply("endpointslices", edit_objects(ip)[1])
            result = json.loads([ln for ln in client.stdout.read().decode().splitlines() if ln.startswith("{")][-1])
            cpus.append(agent.cpu() - cpu0)
            procs.stop(client)
            if result["t"] is not None:
                times.append(result["t"] - t_edit)
            time.sleep(max(0.0, CHANGE_GAP - (time.monotonic() - t_edit)))
        out = {"services": n, "mode": mode, "edit_to_connection_s": pcts(times), "cpu_s": pcts(cpus),
               "samples_s": times, "cpu_samples_s": cpus, "load1": pcts(loads), "lost": count - len(times),
               **agent.memory()}
    finally:
        agent.stop()
        if api is not None:
            api.stop()
        nsexec(topo.node, "nft", "delete", "table", "ip", "usproxy", check=False)  # the next agent starts cold
        nsexec(topo.node, "ip", "link", "del", "usproxy8", check=False)
    return out


# -- kube-proxy's own kernel step ---------------------------------------------------------------------
def kube_proxy(n: int, count: int) -> dict[str, Any]:
    """kube-proxy's nftables layout for n Services through `nft -f -` (knftables' way), cold into
    an empty namespace, and `count` endpoint changes as kube-proxy sends them."""
    with ScratchNetns("kp") as ns:
        text = kube_proxy_ruleset(n)
        t = time.perf_counter()
        r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True, capture_output=True)
        cold_s = time.perf_counter() - t
        if r.returncode != 0:
            return {"services": n, "error": r.stderr.strip()[:300]}
        one = []
        for k in range(count):
            t = time.perf_counter()
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=_kp_change(n // 2, k), text=True,
                           capture_output=True, check=True)
            one.append(time.perf_counter() - t)
    return {"services": n, "cold_s": cold_s, "one_change_s": pcts(one)}


# -- the phase ---------------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def measure(procs: Procs, topo: BenchTopology, work: Path, sizes: tuple[int, ...], rounds: int, count: int,
            log: Log, modes: tuple[str, ...] = ("static", "kubernetes")) -> dict[str, Any]:
    out: dict[str, Any] = {"cold": [], "change": [], "kernel_step": [], "kube_proxy": []}
    for n in sizes:
        for mode in modes:
            runs = [cold(procs, mode, n, work) for _ in range(rounds)]
            row = {"services": n, "mode": mode, "runs": runs,
                   **{k: _median(runs, k) for k in ("spawn_to_kernel_s", "cpu_s", "VmRSS", "VmHWM", "load1",
                                                    "rss_settled", "cpu_listeners_s")}}
            out["cold"].append(row)
            each = ", ".join(f"{r['spawn_to_kernel_s']:.2f}" for r in runs)
            log(f"  cold {mode} {n}: spawn->kernel {row['spawn_to_kernel_s']:.2f}s (runs {each}), cpu {row['cpu_s']:.2f}s, "
                f"RSS {row['VmRSS']:.0f} MiB, {row['rss_settled']:.0f} with listeners (peak {row['VmHWM']:.0f}), "
                f"load {row['load1']:.1f}"
                + "".join(f" ERROR {r['error']}" for r in runs if "error" in r))
            ch = changes(procs, topo, mode, n, count, work)
            out["change"].append(ch)
            e, c = ch["edit_to_connection_s"], ch["cpu_s"]
            log(f"  change {mode} {n}: edit->connection p50 {e.get('p50', float('nan')) * 1e3:.0f} ms "
                f"p99 {e.get('p99', float('nan')) * 1e3:.0f} ms, cpu p50 {c['p50']:.3f}s max {c['max']:.3f}s, "
                f"lost {ch['lost']}, load {ch['load1']['p50']:.1f}")
        k = usproxy_nft(n, 0, rounds)
        out["kernel_step"].append({"services": n, "cold_s": k["cold_s"], "cold_runs_s": k["cold_runs_s"],
                                   "nft_transaction_s": k["cold_nft_transaction_s"]})
        log(f"  kernel step {n}: Proxier.sync into nftables {k['cold_s']:.3f}s")
        kp = kube_proxy(n, 5)
        out["kube_proxy"].append(kp)
        log(f"  kube-proxy layout {n}: nft -f - {kp.get('cold_s', float('nan')):.2f}s {kp.get('error', '')}")
    return out


def _row(rows: list[dict[str, Any]], n: int, mode: str | None = None) -> dict[str, Any]:
    return next((r for r in rows if r["services"] == n and (mode is None or r.get("mode") == mode)), {})


def table(res: dict[str, Any]) -> list[str]:
    """The README's control-plane table: per size, end to end (static, Kubernetes mode), the
    kernel step alone and kube-proxy's layout through nft."""
    head = ["| Services × 2 endpoints | static: spawn → kernel (s) [agent CPU] | its change p50 / p99 (ms) [CPU] "
            "| Kubernetes: spawn → kernel (s) [CPU] | its change p50 / p99 (ms) | RSS after start, static / Kubernetes (MiB) "
            "| kernel step (s) | kube-proxy layout `nft -f -` (s) | its change p50 (ms) |", "|" + "---|" * 9]
    out = list(head)
    for n in sorted({r["services"] for r in res.get("cold", [])}):
        st, kb = _row(res["cold"], n, "static"), _row(res["cold"], n, "kubernetes")
        stc, kbc = _row(res["change"], n, "static"), _row(res["change"], n, "kubernetes")
        ks, kp = _row(res["kernel_step"], n), _row(res["kube_proxy"], n)

        def cold(r: dict[str, Any]) -> str:
            return f"{r['spawn_to_kernel_s']:.2f} [{r['cpu_s']:.2f}]" if r else "–"

        def change(r: dict[str, Any], cpu: bool) -> str:
            if not r or not r["edit_to_connection_s"]:
                return "–"
            e = r["edit_to_connection_s"]
            extra = f" [{r['cpu_s']['p50'] * 1e3:.0f}]" if cpu else ""
            return f"{e['p50'] * 1e3:.0f} / {e['p99'] * 1e3:.0f}{extra}"
        rss = f"{st['rss_settled']:.0f} / {kb['rss_settled']:.0f}" if st and kb else "–"
        kpc = kp.get("one_change_s", {}).get("p50")
        out.append(f"| {n:,} | {cold(st)} | {change(stc, True)} | {cold(kb)} | {change(kbc, False)} | {rss} "
                   f"| {ks.get('cold_s', float('nan')):.3f} | {kp.get('cold_s', float('nan')):.2f} "
                   f"| {kpc * 1e3 if kpc is not None else float('nan'):.1f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--sizes", default="1000,5000,10000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--modes", default="static,kubernetes")
    ap.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench needs root (network namespaces)", file=sys.stderr)
        return 2
    procs, topo = Procs(), BenchTopology()
    work = Path(tempfile.mkdtemp(prefix="usproxy-startup-"))
    try:
        topo.build()
        for ns, name in ((topo.server, "srv"), (topo.server2, "srv2")):
            p = procs.spawn(ns, [PYTHON, "-m", "bench.servers", name], stdout=subprocess.PIPE)
            assert p.stdout is not None
            p.stdout.readline()
        res = measure(procs, topo, work, tuple(int(s) for s in args.sizes.split(",")), args.rounds, args.changes,
                      lambda m: print(m, flush=True), tuple(args.modes.split(",")))
        res["meta"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(), "id": secrets.token_hex(3)}
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
        print("\n".join(table(res)))
    finally:
        procs.close()
        topo.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
