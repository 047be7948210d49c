"""The conformance lab: one node netns with pods, a peer node with the "remote" pods, an external
client, a world router, and the agent under test, switched per (datapath, group, phase).

Topology (tests/netns.py's node, plus): every pod address of every scenario as its own netns on
the node bridge, each running endpoint_server.py on the ports its slices name; netns "ext" on the
bridge with 203.0.113.2/24 and 203.0.113.130/24 behind the node's 203.0.113.1; netns "world" on a
/30 link (addresses.WORLD_LINK) to which the node routes the Service CIDR 10.96.0.0/16 and the
LoadBalancer/external IP range 198.51.100.0/24, and which answers every packet with ICMP host
unreachable (so traffic no datapath handles fails fast, and a DROP is a real drop). ICMP rate
limits are off in node and world so every refusal is seen. LoadBalancer IPs that kube-proxy uses as
a source ("SNATted to the LB IP") are node addresses on lo.

Netns "peer" is a second node on the node bridge (addresses.PEER_NODE) with its own pod bridge
holding the pods of addresses.PEER_PODS; the node routes them through it. It forwards and answers
ARP for its pods (proxy ARP: node-bridge pods see 10.244.0.0/16 as on-link, and the socket LB
connects them straight to an endpoint), reaches the node-bridge pods on-link as they reach each
other, the external clients' network directly on the shared bridge too (as a backend's node
reaches a client through the router, not through the node the client addressed), and everything
else through the node. Other datapaths see no difference: the node's masquerade and SNAT sources
are those of the bridge, as for its own pods. For "bpf-tc-dsr" the peer runs an agent of its own
with the tc programs in DSR mode, as the endpoint's node must; it is started once and follows the
groups' manifests (`Lab._peer_follows`).

`Lab.use(datapath, group, phase)` stops the running agent when the datapath or group changes
(and removes what it left in the kernel with `usproxy run --cleanup`), starts the next one on the
group's manifests and KubeProxyConfiguration, writes phase 1's manifests when asked, and returns
once the datapath under test holds every ServicePort it serves. Everything is stopped and deleted
by `close()`, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import yaml

from tests.conformance import addresses as A
from tests.conformance.manifests import kube_proxy_configuration, objects, pod_addresses
from tests.conformance.probe import Attempt, Spec, run
from tests.netns import Topology, inside, nsexec, sh
from tests.relay.harness import USPROXY, AgentProc, Manifests
from tests.conformance.reference import ALL_GROUPS, Group
from usproxy.util import cgroup2

HERE = Path(__file__).parent
CGROUP2 = cgroup2.mount_point()  # where this host mounts cgroup v2 (the agent's default --bpf-cgroup)
BPFFS = Path("/sys/fs/bpf")
# no --service-cidr: the agents take the Service CIDR from the manifest's ServiceCIDR object, as
# kube-proxy does (manifests.objects)
BPF_DATAPATHS = ("bpf", "bpf-tc", "bpf-tc-dsr")  # `--offload bpf` agents, judged on other flows
TC_DATAPATHS = ("bpf-tc", "bpf-tc-dsr")  # judged on the flows the tc programs serve
PEER_NODE_NAME = "remote"  # TestInternalExternalMasquerade's name for the node of 10.180.1.B
# the node networks of the lab for the peer's agent: its own addresses (10.244.0.250 and its pod
# bridge) and the node's NodePort addresses (addresses.NODE_ADDRESSES)
PEER_NODE_NETWORKS = ("10.244.0.0/16", "192.0.2.0/24", "203.0.113.1/32")
NFT_FLAGS = ("--offload", "nftables", "--offload-after", "1", "--min-sync-period", "200ms")
IPT_FLAGS = ("--offload", "iptables", "--offload-after", "1", "--min-sync-period", "200ms")
LEGACY_HINT = "KUBE-IPTABLES-HINT"  # kubelet's: the agent then picks iptables-legacy (backend.detect)


class BpfAgent(AgentProc):
    """`usproxy run --offload bpf --bpf-lb-mode MODE` in netns `ns` (the node's unless given) via
    nsenter (ip netns exec would hide the cgroup filesystem and bpffs), on a throwaway cgroup and
    pin directory; /healthz and /services as AgentProc reads them, in that netns."""

    def __init__(self, topo: Topology, manifests: Manifests, config: Path, cgroup: Path, pins: Path,
                 lb_mode: str = "snat", ns: str = "") -> None:
        super().__init__(topo, manifests)
        self.config, self.cgroup, self.pins, self.lb_mode = config, cgroup, pins, lb_mode
        self.ns = ns or topo.node

    def _cmd(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}", USPROXY, "-v", "run", *args]

    def get(self, path: str, port: int = 10249) -> Any:
        with inside(self.ns), urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return json.load(r)

    def _env(self) -> dict[str, str]:
        return dict(os.environ, USPROXY_BPF_PINS=str(self.pins))

    def start(self, timeout: float = 10.0) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self._cmd(
                "--services", str(self.manifests.dir), "--config", str(self.config), "--offload", "bpf",
                "--offload-after", "0", "--min-sync-period", "200ms", "--bpf-cgroup", str(self.cgroup),
                "--bpf-lb-mode", self.lb_mode, "--healthz-bind-address",
                "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"), env=self._env(), stdout=out,
                stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        rc = super().stop(sig, timeout)
        subprocess.run(self._cmd("--cleanup", "--bpf-cgroup", str(self.cgroup)), env=self._env(),
                       capture_output=True, timeout=60)
        return rc


class Lab:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.topo = Topology()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pod_ns: dict[str, str] = {}
        self.ext = ""
        self.peer = ""
        self.agent: AgentProc | None = None
        self.peer_agent: BpfAgent | None = None
        self.peer_items: list[dict[str, Any]] = []  # what the peer's manifests hold
        self.state: tuple[str, str, int] | None = None
        self.manifests: Manifests | None = None
        token = secrets.token_hex(4)
        self.cgroup = CGROUP2 / f"usproxy-test-{token}"
        self.pins = BPFFS / f"usproxy-test-{token}"
        self.peer_cgroup = CGROUP2 / f"usproxy-test-{token}-peer"
        self.peer_pins = BPFFS / f"usproxy-test-{token}-peer"

    # -- topology --------------------------------------------------------------------------------
    def build(self) -> None:
        t = self.topo
        t.build_node()
        n = t.node
        nsexec(n, "ip", "addr", "add", f"{A.EXT_GATEWAY}/24", "dev", "usbr0")
        for key in ("net.ipv4.icmp_ratelimit=0", "net.ipv4.conf.all.rp_filter=0"):
            nsexec(n, "sysctl", "-qw", key)
        nsexec(n, "sysctl", "-qw", "net.ipv4.conf.all.send_redirects=0")  # pods reach the peer's through it
        self._world()
        self._external()
        self._peer()
        for ip in _lb_sources():
            nsexec(n, "ip", "addr", "add", f"{ip}/32", "dev", "lo")
        for i, (ip, ports) in enumerate(sorted(pod_addresses().items())):
            ns = self._add_peer_pod(f"p{i}", ip) if A.on_peer_node(ip) else t.add_host(f"p{i}", ip)
            self.pod_ns[ip] = ns
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "endpoint_server.py"), ip,
                                  *map(str, sorted(ports))], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.procs.append(p)
        for p in self.procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        self.cgroup.mkdir()
        self.peer_cgroup.mkdir()

    def _world(self) -> None:
        t, node_side, world_side = self.topo, *A.WORLD_LINK
        world = t.ns("world")
        sh("ip", "netns", "add", world)
        t.namespaces.append(world)
        dev = f"{t.prefix[-6:]}w"
        nsexec(t.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", world)
        nsexec(t.node, "ip", "addr", "add", f"{node_side}/30", "dev", dev)
        nsexec(t.node, "ip", "link", "set", dev, "up")
        for net in ("10.96.0.0/16", "198.51.100.0/24"):
            nsexec(t.node, "ip", "route", "add", net, "via", world_side)
        nsexec(world, "ip", "link", "set", "lo", "up")
        nsexec(world, "ip", "addr", "add", f"{world_side}/30", "dev", "eth0")
        nsexec(world, "ip", "link", "set", "eth0", "up")
        for net in ("10.244.0.0/16", "192.0.2.0/24", "203.0.113.0/24"):
            nsexec(world, "ip", "route", "add", net, "via", node_side)
        nsexec(world, "ip", "route", "add", "unreachable", "default")
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.icmp_ratelimit=0"):
            nsexec(world, "sysctl", "-qw", key)

    def _external(self) -> None:
        t = self.topo
        self.ext = t.ns("ext")
        sh("ip", "netns", "add", self.ext)
        t.namespaces.append(self.ext)
        dev = f"{t.prefix[-6:]}x"
        nsexec(t.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", self.ext)
        nsexec(t.node, "ip", "link", "set", dev, "master", "usbr0", "up")
        nsexec(self.ext, "ip", "link", "set", "lo", "up")
        for ip in ("203.0.113.2", "203.0.113.130"):
            nsexec(self.ext, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        nsexec(self.ext, "ip", "link", "set", "eth0", "up")
        nsexec(self.ext, "ip", "route", "add", "default", "via", A.EXT_GATEWAY)

    def _peer(self) -> None:
        """The peer node (module docstring): eth0 on the node bridge, pod bridge pbr0."""
        t = self.topo
        self.peer = t.ns("peer")
        sh("ip", "netns", "add", self.peer)
        t.namespaces.append(self.peer)
        dev = f"{t.prefix[-6:]}r"
        nsexec(t.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", self.peer)
        nsexec(t.node, "ip", "link", "set", dev, "master", "usbr0", "up")
        nsexec(t.node, "ip", "route", "add", A.PEER_PODS, "via", A.PEER_NODE)
        p = self.peer
        nsexec(p, "ip", "link", "set", "lo", "up")
        nsexec(p, "ip", "addr", "add", f"{A.PEER_NODE}/16", "dev", "eth0")
        nsexec(p, "ip", "link", "set", "eth0", "up")
        nsexec(p, "ip", "link", "add", "pbr0", "type", "bridge")
        nsexec(p, "ip", "addr", "add", f"{A.PEER_BRIDGE}/24", "dev", "pbr0")
        nsexec(p, "ip", "link", "set", "pbr0", "up")
        nsexec(p, "ip", "route", "add", "default", "via", "10.244.0.1")
        nsexec(p, "ip", "route", "add", "203.0.113.0/24", "dev", "eth0")
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.icmp_ratelimit=0", "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.eth0.rp_filter=0", "net.ipv4.conf.eth0.proxy_arp=1",
                    "net.ipv4.neigh.eth0.proxy_delay=0"):
            nsexec(p, "sysctl", "-qw", key)

    def _add_peer_pod(self, short: str, ip: str) -> str:
        """A pod netns with `ip`/24 on the peer node's pod bridge."""
        t = self.topo
        name = t.ns(short)
        sh("ip", "netns", "add", name)
        t.namespaces.append(name)
        outer = f"{t.prefix[-6:]}q{short}"
        nsexec(self.peer, "ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", name)
        nsexec(self.peer, "ip", "link", "set", outer, "master", "pbr0", "up")
        nsexec(name, "ip", "link", "set", "lo", "up")
        nsexec(name, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        nsexec(name, "ip", "link", "set", "eth0", "up")
        nsexec(name, "ip", "route", "add", "default", "via", A.PEER_BRIDGE)
        return name

    def netns_of(self, source: str) -> str:
        if source in self.pod_ns:
            return self.pod_ns[source]
        if A.is_external_client(source):
            return self.ext
        return self.topo.node  # node addresses, and LoadBalancer IPs used as a source

    # -- agents ----------------------------------------------------------------------------------
    def use(self, datapath: str, group: Group, phase: int) -> None:
        if self.state is not None and self.state[:2] == (datapath, group.key) and self.state[2] >= phase:
            return
        if self.state is None or self.state[:2] != (datapath, group.key):
            self._stop(keep_peer=datapath == "bpf-tc-dsr")
            self._start(datapath, group)
        if phase > 0:
            self._write(objects(group, phase))
            self._wait_placed(datapath)
        self.state = (datapath, group.key, phase)

    def _start(self, datapath: str, group: Group) -> None:
        d = self.tmp / f"{datapath}-{group.key}"
        self.manifests = Manifests(d / "services")
        config = d / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump(kube_proxy_configuration(group)))
        self.manifests.write(*objects(group, 0))
        if datapath in BPF_DATAPATHS:
            mode = "dsr" if datapath == "bpf-tc-dsr" else "snat"
            self.agent = BpfAgent(self.topo, self.manifests, config, self.cgroup, self.pins, mode)
            self.agent.start()
            if datapath == "bpf-tc-dsr":
                self._peer_follows(group)
        else:
            if datapath == "iptables-legacy":  # as a node whose kubelet uses iptables-legacy: its hint chain
                nsexec(self.topo.node, "iptables-legacy", "-t", "mangle", "-N", LEGACY_HINT)
            flags = {"nftables": NFT_FLAGS, "iptables": IPT_FLAGS, "iptables-legacy": IPT_FLAGS}.get(datapath, ())
            self.agent = AgentProc(self.topo, self.manifests, "uvloop", "--config", str(config), *flags)
            self.agent.start()
        self._wait_placed(datapath)
        if datapath == "iptables-legacy":
            assert ":KUBE-SERVICES" in nsexec(self.topo.node, "iptables-legacy-save").stdout, "not on iptables-legacy"

    def _peer_follows(self, group: Group) -> None:
        """The peer node's agent in DSR mode as node "remote", on manifests of its own that hold
        the group's: started once, it follows group changes as a node's agent follows the API
        server (a restart per group would only cost time). Its nodePortAddresses are the lab's
        node networks (PEER_NODE_NETWORKS): it hooks its eth0, where DSR packets arrive, and its
        pod bridge, where the replies start, and accepts the DSR option of a NodePort only at an
        address inside them (usproxy/offload/bpf/dsr.h): the node's addresses are not on its
        networks here."""
        if self.peer_agent is not None:
            self._write_peer(objects(group, 0))
            return
        d = self.tmp / "peer"
        manifests = Manifests(d / "services")
        config = d / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump({"apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                                          "kind": "KubeProxyConfiguration", "hostnameOverride": PEER_NODE_NAME,
                                          "nodePortAddresses": list(PEER_NODE_NETWORKS)}))
        self.peer_items = _peer_objects(objects(group, 0))
        manifests.write(*self.peer_items)
        self.peer_agent = BpfAgent(self.topo, manifests, config, self.peer_cgroup, self.peer_pins, "dsr", ns=self.peer)
        self.peer_agent.start()

    def _write(self, items: list[dict[str, Any]]) -> None:
        """The group's manifests for a phase, to the agent under test and the peer's, once synced."""
        assert self.manifests is not None and self.agent is not None
        self.agent.wait_synced_after(self.manifests.write(*items))
        self._write_peer(items)

    def _write_peer(self, items: list[dict[str, Any]]) -> None:
        """`items` but the node's Node object to the peer's manifests, once synced; nothing when
        they hold them already (two groups may share every Service: no sync would follow)."""
        items = _peer_objects(items)
        if self.peer_agent is None or items == self.peer_items:
            return
        self.peer_items = items
        self.peer_agent.wait_synced_after(self.peer_agent.manifests.write(*items))

    def _stop(self, keep_peer: bool = False) -> None:
        if self.peer_agent is not None and not keep_peer:
            peer, self.peer_agent = self.peer_agent, None
            peer.stop()
        if self.agent is None:
            return
        agent, self.agent, self.state = self.agent, None, None
        agent.stop()
        # (without kubelet's hint, --cleanup takes KUBE-FIREWALL too: it is not kept for kubelet)
        nsexec(self.topo.node, "iptables-legacy", "-t", "mangle", "-X", LEGACY_HINT, check=False)
        if not isinstance(agent, BpfAgent):  # BpfAgent.stop cleans up (it knows the cgroup)
            nsexec(self.topo.node, USPROXY, "run", "--cleanup", check=False)
        # check=False: on a kernel without nf_tables (the VM lab's no-xtables guest) nft fails and
        # nothing can be left
        left = nsexec(self.topo.node, "nft", "list", "ruleset", check=False).stdout
        assert "usproxy" not in left and "KUBE-" not in left, left
        left = nsexec(self.topo.node, "iptables-legacy-save", check=False).stdout
        assert "KUBE-" not in left, left

    def services(self) -> list[dict[str, Any]]:
        with inside(self.topo.node), urllib.request.urlopen("http://127.0.0.1:10249/services", timeout=5) as r:
            return list(json.load(r))

    def _wait_placed(self, datapath: str, timeout: float = 60.0) -> None:  # a BPF first sync took > 20 s at load 12
        """Until every ServicePort with endpoints is where the datapath under test puts it, on the
        node and (bpf-tc-dsr) on the peer node."""
        want = {"relay": "userspace", "nftables": "nftables", "bpf": "bpf", "bpf-tc": "bpf", "bpf-tc-dsr": "bpf",
                "iptables": "iptables", "iptables-legacy": "iptables"}[datapath]
        mode = "dsr" if datapath == "bpf-tc-dsr" else "snat"
        deadline = time.monotonic() + timeout
        for agent in (self.agent, self.peer_agent):
            if agent is None:
                continue
            rows: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    rows = agent.services()
                    if rows and all(_placed(r, want, datapath in TC_DATAPATHS, mode) for r in rows if _placeable(r)):
                        break
                time.sleep(0.1)
            else:
                _not_placed(want, rows, agent)
        time.sleep(0.3)

    # -- traffic ---------------------------------------------------------------------------------
    def probe(self, datapath: str, spec: Spec) -> list[Attempt]:
        ns = self.netns_of(spec.src)
        if datapath != "bpf":  # bpf-tc, bpf-tc-dsr: external clients, outside any cgroup
            with inside(ns):
                return run(spec)
        script = (f"echo $$ > {self.cgroup}/cgroup.procs && exec ip netns exec {ns} {sys.executable} "
                  f"{HERE / 'probe.py'} '{json.dumps(asdict(spec))}'")
        proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return [Attempt(**a) for a in json.loads(proc.stdout.strip().splitlines()[-1])]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stop()
        for p in self.procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.topo.close()
        for cgroup in (self.cgroup, self.peer_cgroup):
            _remove_cgroup(cgroup)
        for pins in (self.pins, self.peer_pins):
            assert not pins.exists(), f"pins left: {pins}"


def _remove_cgroup(cgroup: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
    for _ in range(50):
        try:
            cgroup.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.05)


def _peer_objects(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the peer's agent reads of a group's manifest: not the node's Node object (NodeCIDR
    groups), which is not the peer's and changes none of its Services."""
    return [o for o in items if o["kind"] != "Node"]


def _placed(row: dict[str, Any], want: str, tc: bool, mode: str) -> bool:
    """Whether a /services row is on `want`, from outside at tc when `tc`, a NodePort in lb `mode`."""
    if want not in row["datapath"]:
        return False
    return not tc or (row["external"] in ("tc", None) and row["bpfLbMode"] in (mode, None))


def _not_placed(want: str, rows: list[dict[str, Any]], agent: AgentProc) -> NoReturn:
    log = agent.log.read_text()[-3000:]
    raise AssertionError(f"not all on {want}: {[(r['servicePortName'], r['datapath'], r['reason'], r.get('external'), r.get('externalReason'), r.get('bpfLbMode')) for r in rows]}"
                         f"\n{log}")


def _placeable(row: dict[str, Any]) -> bool:
    """ServicePorts the datapath under test must hold: those with endpoints (every one here is TCP or
    UDP with a ClusterIP, so the BPF socket LB takes them all)."""
    return bool(row.get("endpoints"))


def _lb_sources() -> set[str]:
    """LoadBalancer IPs kube-proxy uses as a flow's source (a node address here)."""
    from tests.conformance.manifests import scenario_index
    out = set()
    for group in ALL_GROUPS:
        for sc in group.scenarios:
            k = scenario_index(group, sc)
            for svc in sc.services:
                out |= {A.addr(ip, k) for ip in svc.lb_ips if any(f.source == ip for f in sc.flows)}
    return out
