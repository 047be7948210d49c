"""The rows of /services and /flows: the admin API's JSON, one schema for whoever builds or reads it.

`FlowRow` is built by the relay's flow table (usproxy/flows/flow_table.py), by kernel conntrack
for the nftables datapath (usproxy/offload/kernel_conntrack.py) and by the BPF datapath for its
steered sockets and tc flows (usproxy/offload/bpf/view.py, nodeport.py); `ServiceRow` by the agent
(usproxy/app/agent.py). The admin server and the web view send them as they are; `usproxy status`,
`usproxy flows` and `explain --live` read them back (usproxy/util/table.py renders them). Keys are
the JSON's own (camelCase in /services, as Kubernetes; snake_case in /flows, as conntrack's
counters), so a row is what the client receives. Invariant: plain JSON values only (str, int,
float, bool, None, lists and these dicts), so a row encodes with json.dumps as it is.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class FlowEnds(TypedDict):
    """One direction of a flow: "ip:port" (or "netns:<cookie>" for a socket the BPF socket LB
    steered, whose client has no address yet at connect())."""

    src: str
    dst: str


class FlowRow(TypedDict):
    """One flow, as `conntrack -L` shows an entry: the original direction (client to frontend),
    the reply direction (endpoint to whoever the endpoint answers), counters each way."""

    protocol: str  # "TCP", "UDP", "SCTP"
    state: str  # the datapath's word: a TCP state, "ASSURED", "STEERED", "NAT", "DSR", ...
    age: float | None  # seconds; None where the datapath does not know (kernel conntrack)
    idle: float | None
    original: FlowEnds
    reply: FlowEnds
    packets_in: int  # client -> endpoint
    bytes_in: int
    packets_out: int  # endpoint -> client
    bytes_out: int
    datapath: str  # "userspace", "nftables", "bpf", "bpf-tc"
    service: str  # the ServicePortName key, "ns/name:port/PROTO"
    id: NotRequired[int | str]  # the relay's flow number, "ct-<id>" for kernel conntrack
    endpoint: NotRequired[str]  # "ip:port" where the datapath names it apart from `reply`
    timeout: NotRequired[int]  # seconds left of a kernel conntrack entry


class EndpointRow(TypedDict):
    """One endpoint of a ServicePort, with its EndpointSlice conditions."""

    address: str  # "ip:port"
    ready: bool
    serving: bool
    terminating: bool
    nodeName: str | None
    usable: bool  # among the endpoints the ServicePort's cluster traffic goes to


class ServiceRow(TypedDict):
    """One ServicePort: its spec, its endpoints, and which datapath serves it and why."""

    servicePortName: str
    protocol: str
    clusterIPs: list[str]
    port: int
    nodePort: int  # 0: none
    type: str
    externalIPs: list[str]  # externalIPs and LoadBalancer ingress IPs
    sessionAffinity: str
    affinityTimeoutSeconds: int
    externalTrafficPolicy: str
    internalTrafficPolicy: str
    endpoints: list[EndpointRow]
    datapath: str
    reason: str
    bpfLbMode: str | None  # "snat" or "dsr" where the tc programs serve it from outside
    external: str | None  # the datapath serving it from outside the node, if another
    externalReason: str
    healthCheckNodePort: int
    healthCheckError: str | None
