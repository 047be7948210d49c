"""The explain modes, in the order every view shows them: one `Mode` record each.

This is the one list of modes: `--mode`'s choices, the views and their titles, the tracers,
the rows of "why, in numbers", what `diff` and `--scale` count, and the web view's drawings all
come from it. Adding a mode is adding a record here (with the functions it names).
"""

from __future__ import annotations

from usproxy.explain import (bpf, cost, diff, ipvs, live_nftables, nftables, path_drawing, reply, trace,
                             userspace)
from usproxy.offload.iptables import rules as iptables
from usproxy.explain.ipvs_trace import trace_ipvs
from usproxy.explain.mode import Mode
from usproxy.model.service_set import ServiceSet


def _nftables_dump(ss: ServiceSet) -> str:
    """The nftables view as kube-proxy's transaction lines (`--nft-format dump`)."""
    return nftables.render(ss, "dump")


MODES: tuple[Mode, ...] = (
    Mode("userspace", "userspace: kube-proxy 1.0 portals and proxy, then usproxy's relay",
         render=userspace.render, trace=trace.trace_userspace, reply=reply.userspace_reply,
         refusal=reply.closed_port_refusal, cost_rows=cost.userspace_rows, sends=cost.relay_sends,
         drawing=path_drawing.USERSPACE,
         rules_walked="rules walked (kube-proxy 1.0's portals; the relay walks none)",
         gist="a program accepts the connection and opens a second one to an endpoint (kube-proxy 1.0's "
              "proxy; usproxy's relay, which holds the ClusterIP itself)",
         scale_note="# userspace: RULES WALKED are kube-proxy 1.0's portal rules (a list, like "
                    "iptables'); usproxy's relay walks none: the kernel's socket lookup finds its "
                    "listener (LOOKUPS)"),
    Mode("iptables", "iptables: kube-proxy's iptables mode",
         render=iptables.render, trace=trace.trace_iptables, reply=reply.iptables_reply,
         refusal=reply.icmp_refusal, cost_rows=cost.iptables_rows, cost_detail=cost.ladders,
         sends=diff.iptables_sends_text, diff_sends=diff.iptables_sends_note,
         drawing=path_drawing.IPTABLES,
         gist="a list of rules, one per Service port, walked in order; a ladder of random "
              "probabilities picks the endpoint and DNAT rewrites the destination"),
    Mode("ipvs", "ipvs: kube-proxy's IPVS mode",
         render=ipvs.render, trace=trace_ipvs, reply=reply.ipvs_reply, refusal=reply.icmp_refusal,
         cost_rows=cost.ipvs_rows, sends=cost.ipvs_sends, drawing=path_drawing.IPVS,
         gist="the kernel's IPVS load balancer: a hash table of virtual servers (ClusterIP:port) whose "
              "real servers are the endpoints"),
    Mode("nftables", "nftables: kube-proxy's nftables mode",
         render=nftables.render, render_dump=_nftables_dump, trace=trace.trace_nftables,
         reply=reply.nftables_reply, refusal=reply.icmp_refusal, cost_rows=cost.nftables_rows,
         sends=diff.nftables_sends_text, diff_sends=diff.nftables_sends_note,
         drawing=path_drawing.NFTABLES, live_part=live_nftables.live_part,
         gist="one verdict-map lookup finds the Service, numgen picks the endpoint and dnat rewrites "
              "the destination"),
    Mode("bpf", "bpf: a BPF socket load balancer (cilium-dbg views)",
         render=bpf.render, trace=trace.trace_bpf, traces_pod_at_connect=True, reply=reply.bpf_reply,
         refusal=reply.bpf_refusal, cost_rows=cost.bpf_rows, sends=cost.bpf_sends,
         drawing=path_drawing.BPF,
         gist="a BPF program at connect() connects the socket straight to an endpoint: no packet is "
              "rewritten (Cilium's socket load balancer; usproxy's)"),
)

NAMES: tuple[str, ...] = tuple(m.name for m in MODES)


def by_name(name: str) -> Mode:
    """The record of the mode called `name` (one of NAMES); KeyError else."""
    for m in MODES:
        if m.name == name:
            return m
    raise KeyError(name)


def selected(name: str) -> tuple[Mode, ...]:
    """`--mode`'s value as the modes to show: every mode for "all", else the one named."""
    return MODES if name == "all" else (by_name(name),)
