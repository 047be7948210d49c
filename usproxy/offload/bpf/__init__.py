"""The BPF offload: Cilium's socket load balancer and its tc and XDP NodePort programs, in one object.

Modules: `datapath` (BpfDatapath, the KernelDatapath), `tables` (the maps as typed tables: one
service group at a time, written through a journal), `layout` (the byte form of every key and value,
LAYOUT_VERSION), `loader` (load the object, attach and pin its programs, swap them on restart,
remove them), `map_sizes` (the entries of every map on this machine, set before load: Cilium's
dynamic size ratio and per-map flags), `map_resize` (a pinned map of another size replaced at a
restart, its entries carried over), `cls_bpf` (the tc programs as cls_bpf filters of a clsact
qdisc, where the kernel has no tcx), `libbpf` (a ctypes binding over libbpf.so.1), `build` (compile the C source into
sock_lb-<hash>.o), `nodeport` (which interfaces the tc programs hook and the maps that tell them,
the DSR peers' networks; conntrack rows for /flows), `xdp` (which hooked interfaces can run the XDP program), `maglev` (Maglev
tables, as Cilium builds them) and `view` (the pinned state read back for `explain --live` and
/flows). `layout` and `maglev` are pure; the others reach the kernel (or clang, for `build`).

The C side: `sock_lb.c` holds the cgroup programs (connect, sendmsg, recvmsg, getpeername and
sock_release hooks, IPv4 and IPv6) and, at its end, the tc programs `usp_tc_ingress` and
`usp_tc_egress`; `tc_frontends.h` says which frontends tc serves and what each admits, `dsr.h`
is direct server return (--bpf-lb-mode dsr, and what its backend node trusts), `icmp_error.h` the
reverse NAT of ICMP errors about a flow, and `xdp_lb.h` the XDP program (--bpf-lb-acceleration
native). `layout.py` and the structs at the top of sock_lb.c describe the same bytes.

Traffic served (the datapath's `traffic`):
- `local`: the socket LB rewrites the destination of connect() and of unconnected UDP sendmsg()
  from a ClusterIP to an endpoint for processes in the `--bpf-cgroup` subtree, and rewrites it
  back at recvmsg() and getpeername(): no packet is translated, nothing is in conntrack.
- `forwarded`: the tc programs, attached with tcx (or, on a kernel without it, as cls_bpf filters of
  a clsact qdisc) to every interface holding a NodePort address,
  DNAT (and SNAT to the interface's address, or not for externalTrafficPolicy Local, or DSR)
  IPv4 TCP and UDP packets from outside to NodePorts, LoadBalancer IPs and externalIPs, with
  their own connection tables for the reverse NAT of replies (new flows apart from confirmed ones,
  so a flood of spoofed new flows evicts no established one), of the ICMP errors about them and of
  their fragments. What tc passes (IPv6, a frontend without endpoints, a TCP segment of a flow it
  has no entry for) reaches the stack, where the relay listens. When the
  tc programs cannot be loaded or attached, the datapath serves `local` only and says why.

Maps (layout.py lists each key and value), shaped as Cilium's bpf/lib/lb.h: `usp_services`
(frontend -> count, service id, flags), `usp_slots` (service id, slot -> backend id),
`usp_backends`, `usp_maglev`, `usp_affinity`, `usp_revnat`, `usp_flows` (steered sockets),
`usp_names` (service id -> ServicePortName, for read-back), and for tc `usp_ct`, `usp_ct_any` and
`usp_ct_new` (confirmed TCP, confirmed UDP, not yet confirmed), `usp_frags`, `usp_tc_addrs`,
`usp_tc_ifaces`, `usp_tc_sources` (loadBalancerSourceRanges), `usp_dsr_peers` and
`usp_backend_ids`; `usp_xdp_stats` counts what XDP did. A ServicePort is one service group per IP family (its tc frontends get groups of their own,
flagged F_TC_ONLY); an update writes only the elements that differ, backends first and the service
entry's count last (the programs read slots up to it).

Everything is pinned under `<pin root>/v<LAYOUT_VERSION>/` (maps/, links/, and tc/ for the
programs of cls_bpf filters), so programs stay
attached and maps keep their contents when the agent exits; the next agent reuses the maps, swaps
each link to its new program (never a moment without one) and reads the groups back instead of
rebuilding them (field case C20). Only `usproxy run --cleanup` detaches and unpins.
"""
