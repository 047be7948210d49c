"""The tour: `usproxy tour [--quick] --out DIR` serves one set of Services by each mode in turn,
live on this machine, and measures what the articles about kube-proxy's modes claim.

Three questions, the same traffic for every mode (connections made on the node to ClusterIPs,
answered by five endpoints):
- match cost: new connections per second and the latency of one new connection, for the Service
  first and the one last in iptables' rule order, as the Services grow 10 -> 1,000 -> 10,000;
- update cost: how long one endpoint change takes to reach new connections, and what the
  datapath sends to the kernel for it (its own counter, usproxy_kernel_writes_total);
- uniformity: how 10,000 connections spread over five endpoints, with a chi-square test.

Modules: `runner` (the whole tour, results.json, exit code), `visit` (one mode: the agent up,
the measurements, everything stopped), `network` (the tour's namespaces, cgroup and pin root,
and their removal, also after a killed tour), `processes` (the endpoints, the client and `usproxy
run`, each in its namespace), `manifests` (the Services as a kubectl-style manifest), `client`
and `endpoints` (the programs the tour runs in the namespaces), `stats` (percentiles,
chi-square), `results` (the values and results.json), `plots` and `svg` (the charts and their
captions). The tour uses the datapaths only through `usproxy run` and its /metrics and /services,
as a user would; it never touches the host's own tables.
"""
