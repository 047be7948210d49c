"""The nftables offload: usproxy's tables per IP family, and the datapath that keeps them.

Modules: `names` (table, map and chain names, element comments), `rules` (PortRules: what one
ServicePort holds, from the model), `commands` (nft syntax: the fixed table, shared and per-ServicePort
chains), `transaction` (one atomic change of one family's table, and the TableState it folds into),
`pins` (affinity pins read back and retimed), `datapath` (NftablesDatapath, the KernelDatapath),
`client` (libnftables in a worker thread), `readback` (TableState from `nft -j list table`) and
`fake` (FakeNft, an in-memory nftables for unit tests). All but `client` and `datapath` are pure.

`port_rules()` turns a ServicePortState into PortRules for one IP family, `Transaction` turns
(previous, current) PortRules into element adds and deletes, and `Command`s render as nft syntax
for libnftables. The same Commands drive `FakeNft`, and the tests' packet tracer
(tests/offload/nft_trace.py) reads the rule text the kernel gets.

Layout, one table per family (`ip usproxy`, `ip6 usproxy`), as kube-proxy's nftables mode
(pkg/proxy/nftables/proxier.go: the `service-ips` / `service-nodeports` verdict maps keyed by
address . protocol . port, `no-endpoint-services` with `reject`, masquerade by packet mark) but with
no per-ServicePort chains for the common case, because per-service chains and anonymous vmaps are
what made kube-proxy's layout take 66-75 s for 10,000 Services here (docs/platform.md#nftables):

- a frontend (ClusterIP/externalIP . proto . port, or NodePort proto . port) with N endpoints maps
  in `service-ips` / `service-nodeports` to `goto g-N` (`npg-N` for NodePorts; `gm-N`/`npgm-N` set
  the masquerade mark first). Chain g-N is one rule `numgen random mod N vmap { i : goto s-i }`.
- chain s-i is one rule `dnat to <frontend key> map @slot-i`; map slot-i holds, per frontend, its
  i-th endpoint. So a frontend with N endpoints has one verdict element and N slot elements, and
  the chains are shared by all ServicePorts: their number is the largest N, not the Service count.
- an endpoint change touches only the changed slots (a removed endpoint's slot takes the last
  one, then the verdict moves from g-N to g-(N-1)): cost proportional to the change.
- sessionAffinity ClientIP uses per-ServicePort chains as kube-proxy: per endpoint a set of client
  addresses with a timeout, checked before the numgen choice and refreshed on each new connection.
- lb-policy roundRobin (annotation usproxy.io/lb-policy) also gets a chain of its own per
  ServicePort (`rr-<hash>-<scope>`): `numgen inc mod N vmap { i : goto s-i }`, whose counter is
  that rule's alone. Only annotated ServicePorts pay for a chain; the rest share g-N and pick
  with `numgen random`, as kube-proxy's nftables mode.
- ClusterIP traffic is marked for masquerade as kube-proxy: by `gx-N` only where the local-traffic
  detector says it is not from a pod (TableState.not_local), by `gm-N` all of it with
  masqueradeAll, not at all without either.
- externalTrafficPolicy Local external frontends go to chains of the ServicePort's own: `xl-<hash>`
  (`xl-<hash>n` for the NodePort) sends pod traffic (detector) and node traffic (`fib saddr type
  local`, marked) to `xs-<hash>`, which DNATs to one of every endpoint, and the rest to the local
  endpoints' group chain, or drops it when there is none (kube-proxy's external chain).
- frontends without endpoints are in `no-endpoint-services` / `no-endpoint-nodeports`, which the
  filter hooks turn into `reject` (TCP reset, ICMP port unreachable); a Local policy without a
  local endpoint (the Service has endpoints elsewhere) gets `drop` there instead, as kube-proxy.
- loadBalancerSourceRanges as kube-proxy: `filter-prerouting-pre-dnat` and
  `filter-output-pre-dnat` (priority -110, before DNAT) send new connections to `firewall-check`,
  whose `firewall-ips` map sends each filtered LB IP . proto . port to the ServicePort's chain
  `fw-<hash>`: `ip saddr != { allowed sources } drop`. Only LB IPs are keys: NodePorts, ClusterIPs
  and externalIPs are not filtered. A change of ranges rewrites that one chain; of LB IPs, their
  elements.
- `hairpin` holds endpoint . endpoint pairs: a connection DNATed back to its own source is
  masqueraded (field case C24). Only endpoints that may be on this node get one (see port_rules).
- `ct state invalid drop` on forward (C25), as kube-proxy.
- NodePorts match `fib daddr type local` when every local address serves them, else
  `ip daddr @nodeport-ips` (--nodeport-addresses; the datapath keeps the set's elements), and
  with --service-cidr chain `cluster-ips-check` drops new connections to an address of the Service
  CIDRs that is not local (unallocated), as kube-proxy (commands.HookSettings).

Every verdict element carries the ServicePortName as its comment, so `read back` (readback.py)
can attribute kernel state to ServicePorts after a restart.
"""
