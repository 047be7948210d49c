"""The bench's network namespaces: one node, two server pods, one client.

Built on tests/netns.py's Topology (node netns with bridge usbr0 = 10.244.0.1/16 and the node
addresses, pods on veths into it, 10.96.0.0/16 routed to the node). Added here:
- the client has SOURCES extra /32 addresses, so short-connection tests are not limited by ports;
- every netns gets the full ephemeral port range and TIME_WAIT reuse, the node a short conntrack
  TIME_WAIT (its own netns only), the servers none (tcp_max_tw_buckets=0, see build), large
  accept backlogs;
- the VIPs of contenders that are not usproxy (HAProxy, prototypes) live on the node's `lo`;
- the server pod also answers on ROUTED_IP (a /32), which the client reaches through the node (a
  /32 route via 10.244.0.1, ICMP redirects ignored): the `direct-routed` baseline takes the node's
  routing hop (IP forwarding and conntrack, no NAT) that every ClusterIP path takes, while SERVER_IP
  stays bridged from the client (the `direct` baseline).
`close()` removes every netns (and with it every nft table, address and socket in it) and kills
what still runs inside; run.py calls it on any exit, also on Ctrl-C.
"""

from __future__ import annotations

from tests.netns import Topology, inside, nsexec

__all__ = ["BenchTopology", "inside", "SERVER_IP", "SERVER2_IP", "CLIENT_IP", "ROUTED_IP"]

SERVER_IP = "10.244.1.10"
SERVER2_IP = "10.244.1.11"
CLIENT_IP = "10.244.2.10"
ROUTED_IP = "10.244.1.12"  # the server pod's second address, routed through the node
SOURCES = 16

SYSCTLS = (
    "net.ipv4.ip_local_port_range=1024 65535",
    "net.ipv4.tcp_tw_reuse=1",
    "net.core.somaxconn=65535",
    "net.ipv4.tcp_max_syn_backlog=65535",
)


class BenchTopology:
    """client → node (contenders) → srv, srv2."""

    def __init__(self) -> None:
        self.t = Topology(prefix="bench" + Topology().prefix[3:])
        self.sources = [CLIENT_IP] + [f"10.244.2.{11 + i}" for i in range(SOURCES - 1)]

    @property
    def node(self) -> str:
        return self.t.node

    @property
    def client(self) -> str:
        return self.t.ns("cli")

    @property
    def server(self) -> str:
        return self.t.ns("srv")

    @property
    def server2(self) -> str:
        return self.t.ns("srv2")

    def build(self) -> None:
        self.t.build_node()
        self.t.add_host("srv", SERVER_IP)
        self.t.add_host("srv2", SERVER2_IP)
        self.t.add_host("cli", *self.sources)
        self._route_through_node()
        for ns in self.t.namespaces:
            for kv in SYSCTLS:
                nsexec(ns, "sysctl", "-qw", kv, check=False)
        # Short connections leave conntrack entries in TIME_WAIT on the node (offloaded path);
        # keep them from piling up across rounds. This netns only.
        nsexec(self.node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1", check=False)
        # The servers close first (Connection: close), so their netns holds a TIME_WAIT socket per
        # connection, for 60 s. The next contender's connections reach the server with the same
        # 4-tuple (the client's address and port, the server's) but timestamps and initial
        # sequence numbers the client derived from another destination (a ClusterIP, HAProxy's
        # VIP, the pod itself): TIME_WAIT rejects their SYNs (PAWS) and every one costs a 1 s
        # retransmission. The first contender of a round got ~12k conn/s, the ones after it ~3k,
        # whoever they were. No TIME_WAIT on the servers' side keeps the runs apart.
        for ns in (self.server, self.server2):
            nsexec(ns, "sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0", check=False)

    def _route_through_node(self) -> None:
        """ROUTED_IP on the server pod; the client sends to it via the node, whose ICMP redirects
        ("the server is on your link") the client ignores, so the path stays routed."""
        nsexec(self.server, "ip", "addr", "add", f"{ROUTED_IP}/32", "dev", "eth0")
        nsexec(self.client, "ip", "route", "add", f"{ROUTED_IP}/32", "via", "10.244.0.1")
        for conf in ("all", "default", "eth0"):
            nsexec(self.client, "sysctl", "-qw", f"net.ipv4.conf.{conf}.accept_redirects=0")

    def add_vip(self, address: str) -> None:
        nsexec(self.node, "ip", "addr", "add", f"{address}/32", "dev", "lo")

    def close(self) -> None:
        self.t.close()
