"""Local traffic policies in the relay (`--offload none`) as kube-proxy, with interface detectors,
real traffic on both event loops.

kube-proxy's own flows with a CIDR detector are replayed in tests/conformance; here the detector
is an interface (detectLocalMode BridgeInterface, and InterfaceNamePrefix matching the same
bridge), which the relay applies through the route back to each client and, for drops, the
ingress interface index in the listener's socket filter. Pods sit on the node bridge usbr0; the
outside client comes in on a veth of its own. For an externalTrafficPolicy Local NodePort:
the outside client reaches only the local endpoint, pods and the node itself reach both (kube-
proxy's short-circuit), TCP and UDP; once the local endpoint is gone, the outside client gets no
answer at all (dropped: a timeout, not a refusal) while pods and the node still reach the remote
one. An internalTrafficPolicy Local ClusterIP without a local endpoint is dropped, not refused.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, nsexec, sh
from tests.offload.harness import Pods, tcp_name, udp_socket, wait_listening
from tests.relay.harness import AgentProc, Manifests, slice_, svc

pytestmark = pytest.mark.netns

NODE_IP, EXT_GW, EXT = "192.0.2.10", "203.0.113.1", "203.0.113.2"
LOCAL, REMOTE, POD = "10.244.1.5", "10.244.2.5", "10.244.9.20"
PORTS = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080},
         {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP", "nodePort": 30053}]
SLICE_PORTS = [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 8080, "protocol": "UDP"}]


def manifests(local_endpoint: bool) -> list[dict[str, Any]]:
    eps = [{"ip": REMOTE, "ready": True, "nodeName": "other"}]
    if local_endpoint:
        eps.append({"ip": LOCAL, "ready": True, "nodeName": "test-node"})
    web = svc("web", "10.96.20.10", PORTS, type="NodePort", externalTrafficPolicy="Local")
    itp = svc("itp", "10.96.20.11", PORTS[:1], internalTrafficPolicy="Local")
    return [web, slice_("web", eps, SLICE_PORTS),
            itp, slice_("itp", [{"ip": REMOTE, "ready": True, "nodeName": "other"}], SLICE_PORTS[:1])]


def outcome(ns: str, addr: str, port: int) -> str:
    try:
        return tcp_name(ns, addr, port, timeout=1.5)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return err.strerror or "error"


def names(ns: str, addr: str, port: int, n: int = 8) -> set[str]:
    return {outcome(ns, addr, port) for _ in range(n)}


def udp_names(ns: str, addr: str, port: int, n: int = 8) -> set[str]:
    """The endpoints that answered `n` datagrams, each from a fresh source port (a new flow)."""
    out = set()
    for _ in range(n):
        s = udp_socket(ns)
        s.settimeout(1.0)
        try:
            s.sendto(b"q", (addr, port))
            out.add(s.recv(512).split(b"|")[0].decode())
        except socket.timeout:
            out.add("timeout")
        finally:
            s.close()
    return out


def outside_client(topo: Topology) -> str:
    """Netns "ext" with EXT on a veth of its own into the node (not the pod bridge)."""
    name = topo.ns("ext")
    sh("ip", "netns", "add", name)
    topo.namespaces.append(name)
    dev = f"{topo.prefix[-6:]}e"
    nsexec(topo.node, "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", name)
    nsexec(topo.node, "ip", "addr", "add", f"{EXT_GW}/24", "dev", dev)
    nsexec(topo.node, "ip", "link", "set", dev, "up")
    nsexec(name, "ip", "link", "set", "lo", "up")
    nsexec(name, "ip", "addr", "add", f"{EXT}/24", "dev", "eth0")
    nsexec(name, "ip", "link", "set", "eth0", "up")
    nsexec(name, "ip", "route", "add", "default", "via", EXT_GW)
    return name


@pytest.mark.parametrize("detector", [("BridgeInterface", "--pod-bridge-interface", "usbr0"),
                                      ("InterfaceNamePrefix", "--pod-interface-name-prefix", "usbr")],
                         ids=["bridge", "prefix"])
def test_short_circuit_and_drops_by_interface(topology: Topology, tmp_path: Path, loop_name: str,
                                              detector: tuple[str, str, str]) -> None:
    mode, flag, value = detector
    pods = Pods(topology, tmp_path)
    m = Manifests(tmp_path / "m")
    m.write(*manifests(local_endpoint=True))
    agent = AgentProc(topology, m, loop_name, "--hostname-override", "test-node",
                      "--detect-local-mode", mode, flag, value)
    try:
        pods.add("local", LOCAL)
        pods.add("remote", REMOTE)
        pod = topology.add_host("pod", POD)
        ext = outside_client(topology)
        wait_listening(pod, REMOTE, 8080)
        agent.start()
        node = topology.node
        assert names(ext, NODE_IP, 30080) == {"local"}  # outside: local endpoints only
        assert names(pod, NODE_IP, 30080) == {"local", "remote"}  # a pod: short-circuited to all
        assert names(node, NODE_IP, 30080) == {"local", "remote"}  # the node itself too
        assert udp_names(ext, NODE_IP, 30053) == {"local"}
        assert udp_names(pod, NODE_IP, 30053) == {"local", "remote"}
        assert outcome(pod, "10.96.20.11", 80) == "timeout"  # iTP Local, no local endpoint: dropped

        agent.wait_synced_after(m.write(*manifests(local_endpoint=False)))
        assert outcome(ext, NODE_IP, 30080) == "timeout"  # dropped, not refused (kube-proxy's DROP)
        assert udp_names(ext, NODE_IP, 30053, n=2) == {"timeout"}
        assert names(pod, NODE_IP, 30080) == {"remote"}
        assert names(node, NODE_IP, 30080) == {"remote"}
        assert udp_names(pod, NODE_IP, 30053, n=3) == {"remote"}
        assert not any(f["original"]["src"].startswith(EXT + ":") for f in agent.flows()
                       if f["original"]["dst"].endswith(":30080"))  # the outside client never got a flow
        row = next(r for r in agent.services() if r["servicePortName"] == "default/web:http")
        assert "outside clients dropped" in row["reason"], row["reason"]
    finally:
        agent.stop()
        pods.close()
