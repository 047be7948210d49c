"""`usproxy explain`, `explain trace`, `explain diff`: arguments and the order of the views.

`main(argv)` gets everything after `explain`. Bad input raises ConfigError (usproxy/app/cli.py turns
it into exit 2 with the object and field named); argparse usage errors exit 2 as well; `--live`
with nothing readable exits 1, and so does an input with no Service to render (nothing to show).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from usproxy.util.argument_parser import ArgumentParser, agent_address
from usproxy.explain import cost, diff, pod_source, registry, scale, trace
from usproxy.explain.live import read_live
from usproxy.explain.mode import Mode, TraceOptions
from usproxy.explain.packet import Packet
from usproxy.model.service_set import Node, ServiceSet, load_manifests, service_set
from usproxy.model.config import BPF_LB_MODES
from usproxy.model.manifest import Manifests, objects_from
from usproxy.model.types import IPAddress, IPNetwork, parse_cidr_sloppy, parse_ip_sloppy
from usproxy.util.errors import ConfigError


HTML_SCALE = 1000  # Services `--html` measures "why, in numbers" at, besides the input's own


def numbered(modes: Sequence[Mode]) -> dict[str, str]:
    """The titles of the modes shown by name, numbered 1.. in the order shown (`--mode bpf` is
    "1. bpf"); the sections after them continue from len(modes) + 1."""
    return {m.name: f"{i}. {m.title}" for i, m in enumerate(modes, start=1)}


def _common(p: argparse.ArgumentParser, inputs: bool = True) -> None:
    """The options every view takes; `inputs`: also where the Services come from and
    --nft-format (diff takes two paths instead, and its own --nft-format, dump by default)."""
    if inputs:
        p.add_argument("--services", type=Path, metavar="PATH", help="Kubernetes manifests (file or directory)")
        p.add_argument("--kubeconfig", type=Path, help="list the Services of a live API server instead of --services")
    p.add_argument("--mode", default="all", choices=[*registry.NAMES, "all"], help="the one mode to show (default all)")
    p.add_argument("--node-ip", action="append", default=[], metavar="IP",
                   help="this node's address (repeat or comma-separate); NodePort addresses")
    p.add_argument("--node-name", metavar="NAME", help="decides which endpoints are local")
    p.add_argument("--cluster-cidr", action="append", default=[], metavar="CIDR",
                   help="pod CIDR: enables kube-proxy's local-traffic masquerade rules")
    p.add_argument("--service-cidr", action="append", default=[], metavar="CIDR",
                   help="Service CIDR (repeat or comma-separate; kube-proxy's --service-cluster-ip-range): "
                        "its unallocated addresses dropped (kube-proxy's cluster-ips-check)")
    if inputs:
        p.add_argument("--nft-format", choices=["list", "dump"], default="list",
                       help="`nft list table` text, or kube-proxy's transaction lines")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="usproxy explain",
                       description="render Services as each kube-proxy mode holds them",
                       epilog="usproxy explain trace SRC DST:PORT[/PROTO] --services PATH: the path one "
                              "new connection takes through each mode (see `usproxy explain trace -h`); "
                              "usproxy explain diff OLD NEW: what one change does to each mode's rules")
    _common(p)
    p.add_argument("--live", action="store_true", help="also show this node's running agent")
    p.add_argument("--metrics-bind-address", default="127.0.0.1:10249", metavar="HOST:PORT", type=agent_address,
                   help="where the running agent serves /services and /flows (read with --live; default %(default)s)")
    p.add_argument("--html", type=Path, metavar="FILE",
                   help="write the drawings of every mode, with their rules and why, in numbers (also at "
                        f"--scale N Services, default {HTML_SCALE:,}), as one self-contained HTML file")
    p.add_argument("--tour-results", type=Path, metavar="DIR",
                   help="with --html: also show the plots (*.svg, *.png) of this results directory, with "
                        "the captions of its results.json")
    p.add_argument("--scale", type=_scale_count, metavar="N",
                   help="only why, in numbers, for N Services generated like the input's, measured by "
                        f"rendering and tracing them (N up to {scale.MAX_SERVICES}); with --html, the "
                        "page's numbers at N Services")
    return p


def _scale_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of Services, got {text!r}") from None
    if not 1 <= n <= scale.MAX_SERVICES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {scale.MAX_SERVICES}, got {n}")
    return n


def build_trace_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="usproxy explain trace",
                       description="the path one new connection takes in each mode")
    p.add_argument("src", metavar="SRC",
                   help="the packet's source address. An address in --node-ip is the node itself (the "
                        "output hooks); any other is a packet arriving at the node (prerouting), as a pod "
                        "here and a client elsewhere both look to iptables, ipvs and nftables. bpf alone "
                        "tells them apart: a pod on this node is served at connect(), anything else is "
                        "traffic from elsewhere. SRC is a pod on this node when the input places it here "
                        "(an endpoint's nodeName, or a Node's podCIDRs: without --node-name, the trace "
                        "renders for that node) or when it is in --cluster-cidr")
    p.add_argument("dst", metavar="DST:PORT[/PROTO]", help="the destination; PROTO is TCP, UDP or SCTP (TCP when left out)")
    p.add_argument("--detail", action="store_true",
                   help="every path in full, hop by hop, with what follows its first packet (the "
                        "default prints the hops all paths share once, one path in full and one line "
                        "for each other)")
    p.add_argument("--bpf-lb-mode", choices=BPF_LB_MODES, default="snat",
                   help="as `usproxy run --bpf-lb-mode`: how the bpf mode's tc program serves a packet "
                        "from elsewhere to a NodePort, LB IP or externalIP whose backend is on another "
                        "node: SNAT to the node (default) or direct server return")
    _common(p)
    return p


def _split(values: list[str]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _parsed(values: list[str], flag: str, parse: Callable[[str], object]) -> list[object]:
    out = []
    for v in _split(values):
        try:
            out.append(parse(v))
        except ValueError as err:
            raise ConfigError(str(err), obj="usproxy explain", field=flag) from None
    return out


def node_from(args: argparse.Namespace) -> Node:
    # as the agent parses them: an IPv4-mapped address or range is IPv4 (kube-proxy's IPFamilyOf)
    ips: list[IPAddress] = _parsed(args.node_ip, "--node-ip", parse_ip_sloppy)  # type: ignore[assignment]
    cidrs: list[IPNetwork] = _parsed(args.cluster_cidr, "--cluster-cidr", parse_cidr_sloppy)  # type: ignore[assignment]
    scidrs: list[IPNetwork] = _parsed(args.service_cidr, "--service-cidr", parse_cidr_sloppy)  # type: ignore[assignment]
    return Node(args.node_name, tuple(ips), tuple(cidrs), tuple(scidrs))


def _from_api(kubeconfig: Path) -> Manifests:
    """One list of the API server's Services and EndpointSlices, parsed like manifests."""
    import asyncio

    from usproxy.sources.kube import list_once

    raws = asyncio.run(list_once(kubeconfig))
    return objects_from(list(raws))


def manifests(args: argparse.Namespace) -> Manifests:
    """The objects of --kubeconfig or --services; every error after the first is printed (the
    first is raised when they are made a ServiceSet)."""
    if args.kubeconfig is not None:
        m = _from_api(args.kubeconfig)
    elif args.services is None:
        raise ConfigError("required (or --kubeconfig)", obj="usproxy explain", field="--services")
    else:
        m = load_manifests(args.services)
    for err in m.errors[1:]:
        print(f"usproxy: {err}", file=sys.stderr)
    return m


def load(args: argparse.Namespace) -> ServiceSet:
    return service_set(manifests(args), node_from(args))


def render_mode(ss: ServiceSet, mode: Mode, nft_format: str = "list", title: str = "") -> str:
    """One mode's view under the heading `title` (default: the mode's unnumbered title)."""
    return f"==== {title or mode.title} ====\n\n{mode.view(ss, nft_format)}"


def render_all(ss: ServiceSet, modes: Sequence[Mode], nft_format: str = "list") -> str:
    titles = numbered(modes)
    parts = [render_mode(ss, m, nft_format, titles[m.name]) for m in modes]
    parts.append(f"==== {len(modes) + 1}. why, in numbers ====\n\n" + cost.render(ss, modes))
    if ss.skipped:
        parts.append("# skipped, as kube-proxy skips them:\n" + "\n".join(f"#   {s}" for s in ss.skipped) + "\n")
    return "\n".join(parts)


def _service_addresses(ss: ServiceSet) -> set[IPAddress]:
    return {ip for sp, _ in ss.ports for ip in (*sp.cluster_ips, *sp.external_ips, *sp.load_balancer_ips)}


def nodeport_hint(ss: ServiceSet, pkt: Packet) -> str:
    """A note when DST:PORT looks like a NodePort but DST is not a node address (--node-ip), so
    every mode would route it as addressed; "" otherwise. NodePorts answer only on the node's
    addresses (kube-proxy --nodeport-addresses), which explain learns from --node-ip alone."""
    if pkt.dst_local or pkt.dst in _service_addresses(ss):
        return ""
    names = [str(sp.name) for sp, _ in ss.ports if sp.node_port == pkt.dport and sp.protocol == pkt.proto]
    if not names:
        return ""
    known = ", ".join(map(str, ss.node.ips)) or "none given"
    return (f"# note: port {pkt.dport}/{pkt.proto} is the NodePort of {', '.join(names)}, but {pkt.dst} is "
            f"not one of this node's addresses (--node-ip: {known}); to trace it as a NodePort, "
            f"pass --node-ip {pkt.dst}\n\n")


def lb_source_hint(ss: ServiceSet, pkt: Packet) -> str:
    """A note when the source is a LoadBalancer IP of a Service with loadBalancerSourceRanges
    that no node address (--node-ip) falls in: kube-proxy allows an LB IP as a source only when a
    range holds one of the node's addresses (a load balancer looping the node's own connection
    back, SNATed to the LB IP: KUBE-FW-* `-s <lb ip>`), and explain knows them from --node-ip
    alone; "" otherwise."""
    names = [str(sp.name) for sp, _ in ss.ports if pkt.src in sp.load_balancer_ips and sp.source_ranges
             and not any(ip in r for r in sp.source_ranges for ip in ss.node.ips)]
    if not names:
        return ""
    return (f"# note: {pkt.src} is a LoadBalancer IP of {', '.join(names)}; kube-proxy lets an LB IP through "
            f"loadBalancerSourceRanges as a source (a load balancer looping the node's own connection back) "
            f"only when a range holds one of this node's addresses, which explain knows from --node-ip "
            f"(given: {', '.join(map(str, ss.node.ips)) or 'none'})\n\n")


def empty(ss: ServiceSet, args: argparse.Namespace) -> bool:
    """True (and says so on stderr) when the input holds no ServicePort any mode would render."""
    if ss.ports:
        return False
    source = args.services if args.kubeconfig is None else "the API server"
    print(f"usproxy explain: no Service with a ClusterIP in {source}: nothing to show", file=sys.stderr)
    for s in ss.skipped:
        print(f"usproxy explain: skipped, as kube-proxy skips it: {s}", file=sys.stderr)
    return True


def traced_source(args: argparse.Namespace, m: Manifests) -> tuple[ServiceSet, Packet, str]:
    """The ServiceSet, the packet and a line about SRC. Where the input places SRC on a node
    (pod_source.locate) and --node-name names no other, SRC is a pod on this node and the trace
    renders for that node (its name decides which endpoints are local); a pod the input places
    on another node than --node-name is traced as a packet from elsewhere, and said so."""
    ss = service_set(m, node_from(args))
    pkt = trace.parse_packet(args.src, args.dst, ss)
    place = None if pkt.src_local else pod_source.locate(pkt.src, ss, m.nodes)
    if place is None:
        return ss, pkt, ""
    if args.node_name not in (None, place.node):
        return ss, pkt, (f"{pkt.src} is {place.why}, not on this node (--node-name {args.node_name}): "
                         "traced as a packet arriving from elsewhere")
    if args.node_name is None:
        ss = replace(ss, node=replace(ss.node, name=place.node))
    about = (f"{pkt.src} is {place.why}: traced as a pod on {place.node}, the node this trace renders"
             + ("" if args.node_name else f" (as --node-name {place.node})"))
    return ss, replace(pkt, src_pod=place.how), about


def _trace(argv: list[str]) -> int:
    args = build_trace_parser().parse_args(argv)
    ss, pkt, about = traced_source(args, manifests(args))
    if empty(ss, args):
        return 1
    opts = TraceOptions(bpf_lb_mode=args.bpf_lb_mode)
    story = trace.render(ss, pkt, registry.selected(args.mode), opts, args.detail, about)
    print(nodeport_hint(ss, pkt) + lb_source_hint(ss, pkt) + story, end="")
    return 0


def build_diff_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="usproxy explain diff",
                       usage="usproxy explain diff [options] OLD NEW | --kubeconfig FILE NEW",
                       description="what one change of the Services changes in each mode's rules")
    p.add_argument("paths", type=Path, nargs="+", metavar="OLD NEW",
                   help="manifests before and after the change (files or directories); with "
                        "--kubeconfig, NEW alone")
    p.add_argument("--kubeconfig", type=Path,
                   help="OLD is the Services and EndpointSlices a live API server holds now")
    _common(p, inputs=False)
    p.add_argument("--nft-format", choices=["list", "dump"], default="dump",
                   help="nftables compared as kube-proxy's transaction lines (default dump), or as "
                        "`nft list table` text")
    return p


def _diff_inputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Manifests, Manifests]:
    """(OLD, NEW) manifests: two paths, or the API server's current state and one path.
    Wrong counts of paths are usage errors (exit 2)."""
    if args.kubeconfig is not None:
        if len(args.paths) != 1:
            p.error("with --kubeconfig, give NEW only (OLD is the API server's current state), "
                    f"got {len(args.paths)} paths")
        new = load_manifests(args.paths[0])  # a wrong NEW path fails before the server is asked
        return _from_api(args.kubeconfig), new
    if len(args.paths) != 2:
        p.error(f"give OLD and NEW (or --kubeconfig FILE and NEW), got {len(args.paths)} path(s)")
    return load_manifests(args.paths[0]), load_manifests(args.paths[1])


def _diff(argv: list[str]) -> int:
    p = build_diff_parser()
    args = p.parse_args(argv)
    node = node_from(args)
    old, new = (service_set(m, node) for m in _diff_inputs(p, args))

    modes = registry.selected(args.mode)

    def view(ss: ServiceSet, mode: Mode) -> str:
        return _dump_view(ss, mode, args.nft_format)

    print(diff.render(old, new, modes, view, numbered(modes)), end="")
    return 0


def _dump_view(ss: ServiceSet, mode: Mode, nft_format: str = "dump") -> str:
    """One mode's rules as `explain diff` compares them (nftables as transaction lines unless
    `nft_format` is "list")."""
    return render_mode(ss, mode, nft_format) if ss.ports else "# no Services with a ClusterIP\n"


def _write_html(path: Path, page: Callable[[], str]) -> None:
    """Write the page `page()` makes; a path that cannot be written is bad usage (exit 2), said
    in one line, before the page is made (measuring it takes seconds)."""
    try:
        with path.open("w") as out:
            out.write(page())
    except OSError as err:
        why = err.strerror or str(err)
        if isinstance(err, FileNotFoundError) and not path.parent.is_dir():
            why += f" (no directory {path.parent})"
        raise ConfigError(f"{path}: cannot write: {why}", obj="usproxy explain", field="--html") from None


def main(argv: list[str]) -> int:
    """Exit 0; 1 when there is nothing to show (no Service in the input, or --live found nothing)."""
    if argv[:1] == ["trace"]:
        return _trace(argv[1:])
    if argv[:1] == ["diff"]:
        return _diff(argv[1:])
    args = build_parser().parse_args(argv)
    if args.tour_results is not None and args.html is None:
        build_parser().error("--tour-results goes with --html")
    if args.scale is not None and args.html is None:
        ss = load(args)
        if empty(ss, args):
            return 1
        print(scale.render(ss, args.scale, registry.selected(args.mode), _dump_view), end="")
        return 0
    if args.html is not None:
        from usproxy.explain import standalone_page

        if args.tour_results is not None and not args.tour_results.is_dir():
            raise ConfigError(f"{args.tour_results}: not a directory", obj="usproxy explain", field="--tour-results")
        ss = load(args)
        _write_html(args.html, lambda: standalone_page.render(ss, generated=args.scale or HTML_SCALE,
                                                              tour=args.tour_results))
        print(f"usproxy explain: wrote {args.html}")
        return 0
    shown = 0  # sections printed so far: live is numbered after them
    if args.services is not None or not args.live:
        ss = load(args)
        if empty(ss, args) and not args.live:
            return 1
        if ss.ports:
            print(render_all(ss, registry.selected(args.mode), args.nft_format), end="")
            shown = len(registry.selected(args.mode)) + 1
    if args.live:
        live = read_live(args.metrics_bind_address)
        if live is None:
            print(f"usproxy: --live: no running agent at {args.metrics_bind_address} and no usproxy "
                  "nftables table: nothing to show", file=sys.stderr)
            return 1
        print(f"==== {shown + 1}. live: this node ====\n\n" + live, end="")
    return 0
