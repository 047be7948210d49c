"""usproxy demo: real traffic through ClusterIPs and a NodePort, in network namespaces.

Builds a node namespace running the agent on a copy of examples/, three web pods and a DNS pod
(dnsmasq), and a client namespace; sends requests to the ClusterIP and the NodePort and counts
which pod answered; shows the flow table and `usproxy status`; asks DNS through the kube-dns
ClusterIP with dig; edits the EndpointSlice live and shows the effect; shows that a Service with
no endpoints is refused at once. Everything is torn down at the end, also on Ctrl-C.
Run as root: `bash scripts/demo.sh` (or .venv/bin/python demo/run_demo.py after set-up).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USPROXY = str(ROOT / ".venv" / "bin" / "usproxy")
PREFIX = "usdemo"
NODE = f"{PREFIX}-node"
SHOWN_MAP_LINES = 30  # of the BPF map listing (the rest is counted)
PODS = {"web-1": "10.244.1.10", "web-2": "10.244.2.10", "web-3": "10.244.3.10", "coredns-1": "10.244.4.53"}
CLIENT = ("client", "10.244.9.10")
CGROUP2 = Path("/sys/fs/cgroup/unified")
DEMO_CGROUP = CGROUP2 / "usproxy-demo"
BPFFS = Path("/sys/fs/bpf")
PINS = BPFFS / "usproxy-demo"
WEB_PORT = 18249  # where the demo forwards the web view on this machine
FORWARDER = """
import asyncio, socket, sys
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def serve(r, w):
    try:
        ar, aw = await asyncio.open_connection('127.0.0.1', 10249)
    except OSError:
        w.close()
        return
    await asyncio.gather(pipe(r, aw), pipe(ar, w), return_exceptions=True)
async def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    server = await asyncio.start_server(serve, sock=sock)
    await server.serve_forever()
asyncio.run(main())
"""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, text=True, capture_output=True)


def ns(name: str) -> str:
    return f"{PREFIX}-{name}"


def in_ns(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", name, *args, check=check)


def title(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


class Demo:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="usproxy-demo-"))
        self.agent: subprocess.Popen[bytes] | None = None
        self.bpf_started = False
        self.bpffs_was_mounted = _is_bpffs()

    # -- topology ----------------------------------------------------------------------------
    def build(self) -> None:
        teardown_leftovers()
        sh("ip", "netns", "add", NODE)
        in_ns(NODE, "ip", "link", "set", "lo", "up")
        in_ns(NODE, "ip", "link", "add", "usbr0", "type", "bridge")
        for addr in ("10.244.0.1/16", "192.0.2.10/24"):
            in_ns(NODE, "ip", "addr", "add", addr, "dev", "usbr0")
        in_ns(NODE, "ip", "link", "set", "usbr0", "up")
        in_ns(NODE, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, (name, ip) in enumerate([*PODS.items(), CLIENT]):
            self.add_host(name, ip, i)

    def add_host(self, name: str, ip: str, i: int) -> None:
        n = ns(name)
        sh("ip", "netns", "add", n)
        in_ns(NODE, "ip", "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0", "netns", n)
        in_ns(NODE, "ip", "link", "set", f"veth{i}", "master", "usbr0", "up")
        in_ns(n, "ip", "addr", "add", f"{ip}/16", "dev", "eth0")
        in_ns(n, "ip", "link", "set", "eth0", "up")
        in_ns(n, "ip", "link", "set", "lo", "up")
        in_ns(n, "ip", "route", "add", "default", "via", "10.244.0.1")

    def spawn(self, netns: str, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
        out = log.open("ab") if log else subprocess.DEVNULL
        p = subprocess.Popen(["ip", "netns", "exec", netns, *args], stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start_pods(self) -> None:
        for name, ip in PODS.items():
            if name.startswith("web"):
                self.spawn(ns(name), sys.executable, str(ROOT / "demo" / "pod_server.py"), name, ip, "8080")
        self.spawn(ns("coredns-1"), "dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--pid-file=",
                   "--user=root", "--bind-interfaces", f"--listen-address={PODS['coredns-1']}",
                   "--address=/web.default.svc.cluster.local/10.96.10.10",
                   "--txt-record=whoami.cluster.local,coredns-1")
        time.sleep(0.5)

    def start_agent(self, *extra: str, nsenter: bool = False) -> None:
        if not (self.workdir / "services").exists():
            shutil.copytree(ROOT / "examples", self.workdir / "services")
        log = self.workdir / "agent.log"
        cmd = [USPROXY, "run", "--services", str(self.workdir / "services"), *extra]
        if nsenter:  # keeps the cgroup filesystem and bpffs visible (ip netns exec hides them)
            out = log.open("ab")
            env = dict(os.environ, USPROXY_BPF_PINS=str(PINS))
            self.agent = subprocess.Popen(["nsenter", f"--net=/run/netns/{NODE}", *cmd], stdout=out,
                                          stderr=subprocess.STDOUT, env=env)
            self.procs.append(self.agent)
        else:
            self.agent = self.spawn(NODE, *cmd, log=log)
        for _ in range(100):
            try:
                if not self.admin("/healthz", 10256)["lastUpdated"].startswith("0001"):
                    return
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"agent did not start; log:\n{log.read_text()}")

    def admin(self, path: str, port: int = 10249) -> dict[str, str]:
        out = in_ns(NODE, sys.executable, "-c",
                    f"import urllib.request,sys;sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:{port}{path}',timeout=3).read().decode())",
                    check=False)
        if out.returncode != 0:
            raise OSError(out.stderr.strip().splitlines()[-1] if out.stderr else "no answer")
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    # -- traffic -------------------------------------------------------------------------------
    def requests(self, url: str, n: int) -> Counter[str]:
        code = (f"import urllib.request,collections\nc=collections.Counter()\n"
                f"for _ in range({n}):\n"
                f"  try: c[urllib.request.urlopen('{url}',timeout=3).read().decode().strip()]+=1\n"
                f"  except Exception as e: c['error: '+type(e).__name__]+=1\n"
                f"print(dict(c))")
        out = in_ns(ns(CLIENT[0]), sys.executable, "-c", code)
        return Counter(eval(out.stdout))  # our own printed dict

    def run(self) -> None:
        title("Built: node (agent), pods web-1..3 and coredns-1, a client, all in network namespaces; "
              "the agent's status")
        self.build()
        self.start_pods()
        self.start_agent("--offload-after", "6")
        print(in_ns(NODE, USPROXY, "status").stdout)
        title("30 requests to the ClusterIP http://10.96.10.10/ (round robin over three pods)")
        show(self.requests("http://10.96.10.10/", 30))
        title("30 requests to the NodePort http://192.0.2.10:30080/")
        show(self.requests("http://192.0.2.10:30080/", 30))
        self.show_flows()
        title("DNS through the kube-dns ClusterIP: dig @10.96.0.10")
        for q in ("web.default.svc.cluster.local A", "whoami.cluster.local TXT", "+tcp whoami.cluster.local TXT"):
            print(f"$ dig +short @10.96.0.10 {q}")
            print(in_ns(ns(CLIENT[0]), "dig", "+short", "+time=2", "+tries=1", "@10.96.0.10", *q.split()).stdout.strip())
        title("A Service with no endpoints is refused at once (nothing listens on 10.96.20.20:80)")
        self.refused("10.96.20.20", 80)
        self.live_edit()
        self.offload_phase()
        self.bpf_phase()
        title("Agent log (last lines)")
        print("\n".join((self.workdir / "agent.log").read_text().splitlines()[-6:]))
        self.web_view()

    def web_view(self) -> None:
        """The agent's live page (/view, next to /metrics on 127.0.0.1:10249 in the node namespace),
        forwarded to this machine's 127.0.0.1:WEB_PORT: the listening socket is made here (so it
        lives in this namespace) and handed to a forwarder that runs in the node namespace (so
        its connections to the agent do). With a terminal, waits for Enter before tearing down."""
        title("The live web view: Services, flows, offload events and each mode's path, drawn")
        page = in_ns(NODE, sys.executable, "-c", "import urllib.request;print(urllib.request.urlopen("
                     "'http://127.0.0.1:10249/view',timeout=3).read().decode())", check=False).stdout
        print("the agent serves /view:", "yes" if "usproxy" in page else "no answer")
        try:
            listener = socket.create_server(("127.0.0.1", WEB_PORT))
        except OSError:  # taken: any free port will do
            listener = socket.create_server(("127.0.0.1", 0))
        port, fd = listener.getsockname()[1], listener.fileno()
        self.procs.append(subprocess.Popen(["ip", "netns", "exec", NODE, sys.executable, "-c", FORWARDER, str(fd)],
                                           pass_fds=(fd,)))
        listener.close()
        print(f"web view: http://127.0.0.1:{port}/view  (in the node namespace: http://127.0.0.1:10249/view)")
        print(f"the agent from this machine: usproxy status --metrics-bind-address 127.0.0.1:{port} "
              f"(also flows, explain --live)")
        if sys.stdin.isatty():
            input("open it in a browser on this machine; press Enter to end the demo and tear down ")
        else:
            print("(not a terminal: the demo ends and tears down now, so the address above closes)")

    def show_flows(self) -> None:
        title("The flow table while three connections are open, each has sent a request line (usproxy flows)")
        code = ("import socket,time,subprocess\n"
                "s=[socket.create_connection(('10.96.10.10',80)) for _ in range(3)]\n"
                "[c.sendall(b'GET / HTTP/1.1\\r\\n') for c in s]\n"
                "time.sleep(1.5)\n")
        holder = subprocess.Popen(["ip", "netns", "exec", ns(CLIENT[0]), sys.executable, "-c", code])
        time.sleep(0.8)
        print(in_ns(NODE, USPROXY, "flows").stdout)
        holder.wait()

    def refused(self, ip: str, port: int) -> None:
        code = (f"import socket,time\nt=time.monotonic()\n"
                f"try:\n  socket.create_connection(('{ip}',{port}),timeout=3)\n  print('connected?!')\n"
                f"except OSError as e: print(f'{{e.strerror}} after {{(time.monotonic()-t)*1000:.1f}} ms')")
        print(in_ns(ns(CLIENT[0]), sys.executable, "-c", code).stdout.strip())

    def live_edit(self) -> None:
        title("Live edit: web-3 becomes not ready in the EndpointSlice (file rewritten atomically)")
        path = self.workdir / "services" / "services.yaml"
        text = path.read_text()
        marker = "  - addresses: [10.244.3.10]\n    conditions: {ready: true, serving: true, terminating: false}"
        edited = text.replace(marker, marker.replace("ready: true", "ready: false"), 1)
        tmp = path.with_name(".services.yaml.tmp")
        tmp.write_text(edited)
        os.rename(tmp, path)
        time.sleep(1.0)
        show(self.requests("http://10.96.10.10/", 30))

    def offload_phase(self) -> None:
        title("Kernel offload: after 6 s of stable endpoints (--offload-after 6) web:http moves to nftables")
        where = self.wait_offloaded("default/web:http", 20.0)
        print(f"default/web:http is now served by: {where}")
        print(in_ns(NODE, USPROXY, "status").stdout)
        if "nftables" not in where:
            return
        before = self.relay_flows_total()
        show(self.requests("http://10.96.10.10/", 30), "ClusterIP 10.96.10.10:80")
        show(self.requests("http://192.0.2.10:30080/", 30), "NodePort 192.0.2.10:30080")
        print(f"new flows through the userspace relay during those 60 requests: "
              f"{self.relay_flows_total() - before:.0f} (the kernel carried them)")
        title("The kernel's view: nft list table ip usproxy (ServicePort maps and endpoint slots)")
        out = in_ns(NODE, "nft", "list", "table", "ip", "usproxy", check=False).stdout
        heads = ("map service-ips", "map service-nodeports", "map slot-0", "map slot-1", "chain g-2")
        print(excerpt(out, heads))
        print(f"(an excerpt: {len(heads)} of the table's {blocks(out)} maps, sets and chains; other "
              "chains these maps jump to, such as the other g-N and the affinity chains, are not shown)")

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()

    def cleanup_kernel(self) -> None:
        """`usproxy run --cleanup` in the node netns: nftables table, BPF programs and pins."""
        env = dict(os.environ, USPROXY_BPF_PINS=str(PINS))
        subprocess.run(["nsenter", f"--net=/run/netns/{NODE}", USPROXY, "run", "--cleanup",
                        "--bpf-cgroup", str(DEMO_CGROUP)], env=env, capture_output=True)

    def bpf_phase(self) -> None:
        title("BPF: the socket LB rewrites the destination at connect() (as Cilium's kube-proxy replacement)")
        if not (CGROUP2 / "cgroup.procs").exists():
            print(f"skipped: no cgroup v2 at {CGROUP2}")
            return
        self.stop_agent()
        self.cleanup_kernel()
        DEMO_CGROUP.mkdir(exist_ok=True)
        self.bpf_started = True
        print(f"agent restarted with --offload bpf --bpf-cgroup {DEMO_CGROUP}")
        self.start_agent("--offload", "bpf", "--offload-after", "1", "--bpf-cgroup", str(DEMO_CGROUP),
                         nsenter=True)
        where = self.wait_offloaded("default/web:http", 20.0)
        print(f"default/web:http is now served by: {where}")
        if "bpf" not in where:
            return
        before = self.relay_flows_total()
        code = ("import socket\nfor _ in range(6):\n"
                "  s=socket.create_connection(('10.96.10.10',80),timeout=3)\n"
                "  s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n"
                "  body=s.makefile('rb').read().decode().split('\\r\\n\\r\\n')[-1].strip()\n"
                "  print(f'getpeername={s.getpeername()[0]}:{s.getpeername()[1]}  answered by {body}')\n")
        script = f"echo $$ > {DEMO_CGROUP}/cgroup.procs && exec ip netns exec {ns(CLIENT[0])} {sys.executable} -c \"$0\""
        out = subprocess.run(["sh", "-c", script, code], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip())
        print(f"new flows through the userspace relay: {self.relay_flows_total() - before:.0f} "
              "(the socket went straight to the pod; the application still sees the ClusterIP)")
        title("usproxy's BPF maps (pinned under bpffs)")
        view = subprocess.run([sys.executable, "-c", "from usproxy.offload.bpf.view import render_pinned;"
                               "print(render_pinned())"], capture_output=True, text=True,
                              env=dict(os.environ, USPROXY_BPF_PINS=str(PINS)))
        lines = (view.stdout or view.stderr).splitlines()
        print("\n".join(lines[:SHOWN_MAP_LINES]))
        if len(lines) > SHOWN_MAP_LINES:  # say so: a Service missing from a cut listing looks lost
            print(f"... {len(lines) - SHOWN_MAP_LINES} more lines not shown")

    def wait_offloaded(self, name: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        where = "?"
        while time.monotonic() < deadline:
            rows = self.admin("/services")
            where = next((r["datapath"] for r in rows if r["servicePortName"] == name), "?")  # type: ignore[index,attr-defined]
            if "nftables" in where or "bpf" in where:
                break
            time.sleep(0.3)
        return where

    def relay_flows_total(self) -> float:
        text = in_ns(NODE, sys.executable, "-c",
                     "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:10249/metrics').read().decode())").stdout
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("usproxy_flows_total{"))

    def close(self) -> None:
        self.stop_agent()
        if self.bpf_started:
            self.cleanup_kernel()
            _remove_cgroup(DEMO_CGROUP)
            if not self.bpffs_was_mounted and _is_bpffs() and not _pinned_anything():
                subprocess.run(["umount", str(BPFFS)], check=False)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        teardown_leftovers()
        shutil.rmtree(self.workdir, ignore_errors=True)


def excerpt(table: str, heads: tuple[str, ...]) -> str:
    """The blocks of `nft list table` output whose first line starts with one of `heads`."""
    out, keep = [], False
    for line in table.splitlines():
        stripped = line.strip()
        if stripped.startswith(("map ", "set ", "chain ")):
            keep = stripped.startswith(heads)
        if keep:
            out.append(line)
    return "\n".join(out)


def blocks(table: str) -> int:
    """How many maps, sets and chains `nft list table` output holds."""
    return sum(1 for line in table.splitlines() if line.strip().startswith(("map ", "set ", "chain ")))


def show(counts: Counter[str], via: str = "") -> None:
    print((f"{via}: " if via else "") + "answered by: " + "  ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


def _is_bpffs() -> bool:
    return any(line.split()[1:3] == [str(BPFFS), "bpf"] for line in Path("/proc/mounts").read_text().splitlines())


def _pinned_anything() -> bool:
    """bpffs holds pins besides the kernel's own preloaded iterators (maps.debug, progs.debug)."""
    return any(not p.name.endswith(".debug") for p in BPFFS.iterdir())


def _remove_cgroup(cg: Path) -> None:
    if not cg.exists():
        return
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(50):
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def teardown_leftovers() -> None:
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(PREFIX + "-"):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)


def main() -> int:
    if os.geteuid() != 0:
        print("the demo needs root (network namespaces)", file=sys.stderr)
        return 1
    demo = Demo()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        demo.run()
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: tearing down", file=sys.stderr)
        return 130
    finally:
        demo.close()


if __name__ == "__main__":
    sys.exit(main())
