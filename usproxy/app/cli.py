"""The `usproxy` command: run, explain, flows, status, check, tour.

Exit codes: 0 done, 1 runtime failure, 2 bad usage or bad input (the message names the object
and field).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import json
import logging
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from usproxy.util.argument_parser import ArgumentParser, agent_address
from usproxy.model.datapath_name import KERNEL_DATAPATH_NAMES, OFFLOAD_MODES
from usproxy.model.config import (
    ProxyConfig,
    load_kube_proxy_configuration,
    parse_cidrs,
    parse_duration,
    parse_nodeport_addresses,
    with_overrides,
)
from usproxy.util.errors import AlreadyRunning, CannotRun, ConfigError, SourceError
from usproxy.util.lean_import import lean_pyroute2

log = logging.getLogger("usproxy")


def _run_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run the agent")
    p.add_argument("--services", type=Path, help="Kubernetes manifests (file or directory)")
    p.add_argument("--kubeconfig", type=Path, help="watch the API server of this kubeconfig")
    p.add_argument("--config", type=Path, help="a KubeProxyConfiguration file; flags override it")
    d = ProxyConfig()  # the defaults the help states are the ones the agent uses
    p.add_argument("--offload", choices=OFFLOAD_MODES,
                   help="kernel datapaths that may serve ServicePorts: auto = the ladder "
                        f"{' -> '.join(KERNEL_DATAPATH_NAMES)} -> relay, per traffic kind the first this "
                        "kernel has; a name = that one only; none = the relay serves everything "
                        f"(default {d.offload})")
    p.add_argument("--offload-after", type=float, metavar="SECONDS",
                   help="a ServicePort's endpoints must be unchanged this long before it is offloaded; "
                        f"the relay serves it meanwhile (default {d.offload_after:g})")
    p.add_argument("--healthz-bind-address", metavar="HOST:PORT",
                   help=f"serves /healthz and /livez, as kube-proxy's (default {d.healthz_bind_address})")
    p.add_argument("--metrics-bind-address", metavar="HOST:PORT",
                   help="serves /metrics, /services and /flows (read by `usproxy status` and `flows`) "
                        f"(default {d.metrics_bind_address})")
    p.add_argument("--hostname-override", metavar="NAME",
                   help="this node's name (default $NODE_NAME, else with --kubeconfig the hostname, as kube-proxy)")
    p.add_argument("--nodeport-addresses", metavar="CIDR,...|primary", type=_comma_list,
                   help="addresses that serve NodePorts: local addresses in these CIDRs, or 'primary'")
    p.add_argument("--service-cidr", dest="service_cidrs", metavar="CIDR,...", type=_comma_list,
                   help="the cluster's Service CIDRs: traffic to an unallocated address in them is dropped")
    p.add_argument("--vip-interface", metavar="NAME",
                   help=f"the interface that holds the ClusterIPs as local addresses (default {d.vip_interface})")
    p.add_argument("--hairpin-mark", type=_integer, metavar="BIT",
                   help="the mark bit of connections a load balancer hairpins (source and destination a "
                        "LoadBalancer IP), whose answers are routed back out; one bit no other program on the "
                        f"node uses, or 0 to leave such connections unserved (default {d.hairpin_mark:#x})")
    p.add_argument("--lb-policy", choices=["roundRobin", "random", "leastConnections"],
                   help="how a new connection picks an endpoint when its Service has no usproxy.io/lb-policy "
                        "annotation: the relay and the BPF socket LB follow it (BPF picks at random for "
                        "leastConnections); nftables picks at random and leaves leastConnections to the "
                        f"relay (default {d.lb_policy})")
    p.add_argument("--sync-period", metavar="DURATION",
                   help="a full sync at least this often (default 30s, as kube-proxy; greater than 0)")
    p.add_argument("--min-sync-period", metavar="DURATION",
                   help="syncs at most this often, changes batched meanwhile (default 250ms)")
    p.add_argument("--conntrack-max-per-core", type=int, metavar="N",
                   help="the relay's flow table holds N per CPU, at least --conntrack-min (default 32768, "
                        "kube-proxy's rule)")
    p.add_argument("--conntrack-min", type=int, metavar="N", help="the flow table's least size (default 131072)")
    p.add_argument("--udp-idle-timeout", metavar="DURATION",
                   help="a relayed UDP session idle this long ends (default 30s)")
    p.add_argument("--conntrack-tcp-timeout-established", dest="tcp_established_timeout", metavar="DURATION",
                   help="a relayed TCP connection idle this long is reset (default 24h, as kube-proxy's flag)")
    p.add_argument("--conntrack-tcp-timeout-close-wait", dest="tcp_close_wait_timeout", metavar="DURATION",
                   help="a half-closed relayed TCP connection idle this long is reset (default 1h)")
    p.add_argument("--bpf-cgroup", type=Path, metavar="DIR",
                   help="the cgroup v2 directory whose processes' connect() the BPF socket LB rewrites "
                        f"(default: where /proc/self/mountinfo puts cgroup v2, here {d.bpf_cgroup})")
    p.add_argument("--bpf-lb-mode", choices=["snat", "dsr"],
                   help="NodePorts, LB IPs and externalIPs at tc (--offload bpf), backend on another node: SNAT to the node "
                        "(default) or direct server return, the client's address kept (Cilium's)")
    p.add_argument("--bpf-lb-acceleration", choices=["native", "disabled"],
                   help="--offload bpf: serve NodePorts at XDP on interfaces with native XDP, tc elsewhere "
                        "(Cilium's flag; default disabled)")
    p.add_argument("--enable-tcx", type=_bool, nargs="?", const=True, metavar="true|false",
                   help="attach the tc programs with tcx where the kernel has it (default true; false: through a "
                        "clsact qdisc's cls_bpf filters, as on kernels before 6.6) (Cilium's flag)")
    p.add_argument("--bpf-map-dynamic-size-ratio", type=float, metavar="RATIO",
                   help="share of the machine's memory (MemTotal) the BPF connection and socket tables are sized "
                        f"to, as Cilium's (default {d.bpf_map_dynamic_size_ratio}; 0: fixed default sizes)")
    for flag, what, default in (
            ("--bpf-ct-global-tcp-max", "the tc programs' TCP connection table", "0: sized to the memory"),
            ("--bpf-ct-global-any-max", "the tc programs' UDP and not-yet-confirmed connection tables",
             "0: sized to the memory"),
            ("--bpf-sock-rev-map-max", "the socket LB's per-socket tables (reverse translation, steered sockets)",
             "0: sized to the memory"),
            ("--bpf-lb-map-max", "the load-balancing tables (services, slots, backends, Maglev)",
             f"{d.bpf_lb_map_max}"),
            ("--bpf-lb-affinity-map-max", "the sessionAffinity table", "0: as --bpf-lb-map-max"),
            ("--bpf-fragments-map-max", "the tc programs' IPv4 fragment table", f"{d.bpf_fragments_map_max}")):
        p.add_argument(flag, type=int, metavar="N", help=f"entries of {what} (default {default}; Cilium's flag)")
    p.add_argument("--relay-capture", choices=["auto", "nftables", "iptables", "none"],
                   help="capture a relayed frontend whose port a node socket holds (0.0.0.0:PORT) ahead of the "
                        "kernel's socket lookup: auto (default) takes the first that works of nftables, iptables")
    p.add_argument("--cluster-cidr", dest="cluster_cidrs", metavar="CIDR[,CIDR]",
                   type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
                   help="pod network: ClusterIP traffic from outside it is masqueraded (kube-proxy's)")
    p.add_argument("--detect-local-mode", choices=["ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix"],
                   help="what counts as traffic from a pod, as kube-proxy's (default ClusterCIDR)")
    p.add_argument("--pod-bridge-interface", dest="bridge_interface", metavar="NAME",
                   help="--detect-local-mode BridgeInterface: the pods' bridge")
    p.add_argument("--pod-interface-name-prefix", dest="interface_name_prefix", metavar="PREFIX",
                   help="--detect-local-mode InterfaceNamePrefix: the pods' interfaces' name prefix")
    p.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade all traffic to Service addresses (kube-proxy's --masquerade-all)")
    p.add_argument("--tour-results", type=Path, metavar="DIR",
                   help="a tour's results directory: the web view (/view) shows its plots (*.svg, *.png) "
                        "with the captions of its results.json")
    p.add_argument("--iptables-localhost-nodeports", dest="iptables_localhost_nodeports", type=_bool,
                   metavar="true|false", help="the iptables datapath serves NodePorts on 127.0.0.1 too, where "
                   "every IPv4 address serves them (kube-proxy's; it sets route_localnet; default true)")
    p.add_argument("--cleanup", action="store_true", default=None,
                   help="remove everything usproxy installed in the kernel, then exit")


def _bool(text: str) -> bool:
    """true/false, as Cilium's boolean flags take them (--enable-tcx=false)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _integer(text: str) -> int:
    """A number as C writes it: 4096, 0x1000, 0o10000."""
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (4096, 0x1000), got {text!r}") from None


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="usproxy", description="A Kubernetes Service proxy in Python")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    e = sub.add_parser("explain", help="render Services as each kube-proxy mode would hold them; "
                       "`explain trace`: one connection's path, `explain diff`: what one change does")
    e.add_argument("rest", nargs=argparse.REMAINDER)
    for name, helptext in (("flows", "print the running agent's flow table"),
                           ("status", "print the running agent's ServicePorts")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--metrics-bind-address", default="127.0.0.1:10249", metavar="HOST:PORT", type=agent_address,
                       help="where the running agent serves /services and /flows (default %(default)s)")
        s.add_argument("--json", action="store_true")
    c = sub.add_parser("check", help="probe this node's kernel datapaths")
    c.add_argument("--json", action="store_true")
    t = sub.add_parser("tour", help="serve one set of Services by each mode in turn (relay, iptables, IPVS, "
                       "nftables, BPF), live in network namespaces of its own, and measure them (as root)")
    t.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where results.json and the plots go (the web view and explain --html read them "
                        "with --tour-results DIR)")
    t.add_argument("--quick", action="store_true",
                   help="10 and 1,000 Services with shorter windows (under 3 minutes) instead of 10, 1,000 "
                        "and 10,000 (under 10)")
    t.add_argument("--modes", type=_comma_list, metavar="MODE,...",
                   help="only these of relay, iptables, ipvs, nftables, bpf (default: all of them)")
    return parser


SWITCH_INTERVAL = 0.001  # seconds; see cmd_run
FLAG_OF_DURATION = {"sync_period": "--sync-period", "min_sync_period": "--min-sync-period",
                    "udp_idle_timeout": "--udp-idle-timeout",
                    "tcp_established_timeout": "--conntrack-tcp-timeout-established",
                    "tcp_close_wait_timeout": "--conntrack-tcp-timeout-close-wait"}


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Flags over the --config file; raises ConfigError (exit 2) naming the flag at fault."""
    cfg = load_kube_proxy_configuration(args.config) if args.config else ProxyConfig()
    overrides = {k: getattr(args, k) for k in vars(args) if k not in ("command", "verbose", "config")}
    for key, flag in FLAG_OF_DURATION.items():
        if overrides.get(key) is not None:
            overrides[key] = parse_duration(overrides[key], flag)
    cfg = with_overrides(cfg, overrides)
    validate(cfg, given_services=args.services is not None, given_kubeconfig=args.kubeconfig is not None)
    return cfg


def _interface_name_ok(name: str) -> bool:
    """As the kernel's dev_valid_name: 1-15 bytes (IFNAMSIZ 16 with its NUL), not "." or "..",
    no '/', ':' or white space."""
    return (0 < len(name.encode()) < 16 and name not in (".", "..")
            and not any(c in "/:" or c.isspace() for c in name))


def validate(cfg: ProxyConfig, *, given_services: bool, given_kubeconfig: bool) -> None:
    """Reject settings that cannot work before anything starts."""
    from usproxy.model.node import detector_of
    from usproxy.model.service_set import require_path
    from usproxy.util import host_port

    if given_services and given_kubeconfig:
        raise ConfigError("give --services or --kubeconfig, not both", obj="usproxy run")
    if cfg.services is not None:  # before the agent says anything
        require_path(cfg.services)
    for flag, value in (("--healthz-bind-address", cfg.healthz_bind_address),
                        ("--metrics-bind-address", cfg.metrics_bind_address)):
        if value:
            try:
                host_port.bind_address(value)
            except ValueError as err:
                raise ConfigError(str(err), obj="usproxy run", field=flag) from None
    for flag, seconds in (("--offload-after", cfg.offload_after), ("--sync-period", cfg.sync_period),
                          ("--min-sync-period", cfg.min_sync_period),
                          ("--udp-idle-timeout", cfg.udp_idle_timeout),
                          ("--conntrack-tcp-timeout-established", cfg.tcp_established_timeout),
                          ("--conntrack-tcp-timeout-close-wait", cfg.tcp_close_wait_timeout)):
        if not seconds >= 0 or seconds == float("inf"):  # also NaN
            raise ConfigError(f"must be a finite number of seconds, not negative, got {seconds}",
                              obj="usproxy run", field=flag)
    if cfg.hairpin_mark and (cfg.hairpin_mark & (cfg.hairpin_mark - 1) or not 0 < cfg.hairpin_mark < 1 << 32):
        raise ConfigError(f"must be one bit of a 32-bit mark (e.g. 0x1000) or 0, got {cfg.hairpin_mark:#x}",
                          obj="usproxy run", field="--hairpin-mark")
    if cfg.sync_period <= 0:
        raise ConfigError(f"must be greater than 0, got {cfg.sync_period}", obj="usproxy run", field="--sync-period")
    if not _interface_name_ok(cfg.vip_interface):
        raise ConfigError(f"not a network interface name (1-15 characters, no '/', ':' or space), got "
                          f"{cfg.vip_interface!r}", obj="usproxy run", field="--vip-interface")
    for flag, n in (("--conntrack-max-per-core", cfg.conntrack_max_per_core), ("--conntrack-min", cfg.conntrack_min)):
        if n < 0:
            raise ConfigError(f"must not be negative, got {n}", obj="usproxy run", field=flag)
    if cfg.detect_local_mode != "NodeCIDR":  # NodeCIDR's pod CIDRs are the Node's, read at start
        detector_of(cfg, quiet=True)  # detectLocalMode and its CIDR or interface; the agent logs it
    try:
        parse_nodeport_addresses(cfg.nodeport_addresses)
        parse_cidrs(cfg.service_cidrs, "--service-cidr")
    except ConfigError as err:
        raise ConfigError(str(err), obj="usproxy run") from None
    from usproxy.offload.bpf import map_sizes
    from usproxy.offload.settings import map_size_flags

    map_sizes.validate(map_size_flags(cfg))


def cmd_run(args: argparse.Namespace) -> int:
    from usproxy.app.privileges import require_net_admin

    cfg = config_from_args(args)
    require_net_admin("usproxy run --cleanup" if cfg.cleanup else "usproxy run")
    if cfg.cleanup:
        from usproxy.app.cleanup import cleanup

        return int(cleanup(cfg))
    if cfg.services is None:
        from usproxy.app.agent import uses_api_server

        if not uses_api_server(cfg):  # before anything is built (and logs)
            raise ConfigError("give --services PATH or --kubeconfig PATH", obj="usproxy run")
    # A static agent's manifests are read now and partly parsed by a forked child while the
    # agent starts (sources/parse_helper.py): before any import below, thread or event loop.
    prefetch = None
    if cfg.services is not None:
        from usproxy.sources.parse_helper import Prefetch

        prefetch = Prefetch.start(cfg.services)
    from usproxy.app.agent import Agent

    agent: list[Agent] = []

    async def main() -> None:
        from usproxy.app.agent import node_facts

        agent.append(Agent(cfg, node=await node_facts(cfg), prefetch=prefetch))
        await agent[0].run()

    # Worker threads (list decoding, admin snapshots, large endpoint diffs) hand the GIL back every
    # 1 ms instead of CPython's 5 ms: a relayed connection waits at most that long for the loop
    # while one runs (the loop holds the GIL only between its own short callbacks).
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        # USPROXY_EVENT_LOOP=asyncio runs on the default loop (tests run every relay case on both).
        if os.environ.get("USPROXY_EVENT_LOOP") == "asyncio":
            asyncio.run(main())
        else:
            import uvloop

            uvloop.run(main())
    finally:
        if prefetch is not None:  # the agent stopped before its source took them
            prefetch.close()
    return agent[0].exit_code if agent else 1


def _get_json(addr: str, path: str) -> Any:
    url = f"http://{addr}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)
    except (urllib.error.URLError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"{url}: {reason} (is `usproxy run` serving --metrics-bind-address {addr}?)") from None


def cmd_status(args: argparse.Namespace) -> int:
    from usproxy.util.table import render_services

    rows = _get_json(args.metrics_bind_address, "/services")
    print(json.dumps(rows, indent=1) if args.json else render_services(rows))
    return 0


def cmd_flows(args: argparse.Namespace) -> int:
    from usproxy.util.table import render_flows

    rows = _get_json(args.metrics_bind_address, "/flows")
    print(json.dumps(rows, indent=1) if args.json else render_flows(rows))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from usproxy.app.capabilities import probe_all, stderr_captured, unprivileged
    from usproxy.app.privileges import has_net_admin
    from usproxy.util.table import render_table

    privileged = has_net_admin()
    with stderr_captured() as written:
        caps = probe_all()
        noise = written()
    if privileged:
        sys.stderr.write(noise)
    else:  # what the libraries printed about permission the rows say, and the last line
        caps = unprivileged(caps)
    if args.json:
        print(json.dumps([c.as_dict() for c in caps], indent=1))
    else:
        print(render_table(["capability", "available", "detail"],
                           [[c.name, "yes" if c.available else "no", c.detail] for c in caps]))
    if not privileged:  # every probe that needs it said "not permitted": no answer about the node
        print("usproxy check: not permitted: without CAP_NET_ADMIN the probes cannot tell what this "
              "node supports; run it as root", file=sys.stderr)
        return 1
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from usproxy.explain.cli import main as explain_main

    return int(explain_main(args.rest))


def cmd_tour(args: argparse.Namespace) -> int:
    from usproxy.app.privileges import require_net_admin
    from usproxy.tour import runner

    wrong = [m for m in args.modes or () if m not in runner.MODE_NAMES]
    if wrong:
        raise ConfigError(f"unknown mode {', '.join(wrong)} (the modes: {', '.join(runner.MODE_NAMES)})",
                          obj="usproxy tour", field="--modes")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"{args.out} exists and is not a directory", obj="usproxy tour", field="--out")
    require_net_admin("usproxy tour")
    return runner.run(args.out, runner.QUICK if args.quick else runner.FULL, tuple(args.modes or runner.MODE_NAMES))


COMMANDS = {"run": cmd_run, "status": cmd_status, "flows": cmd_flows, "check": cmd_check,
            "explain": cmd_explain, "tour": cmd_tour}


def _error_line(err: ConfigError) -> str:
    """"usproxy: <err>", once: an error whose object is a command ("usproxy run: ...") names
    usproxy already."""
    text = str(err)
    return text if err.obj.startswith("usproxy") else f"usproxy: {text}"


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush of a closed pipe stays silent
    (Python's documented recipe for SIGPIPE, library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # argparse's REMAINDER does not take options that come first ("explain --services x"), so
    # everything after "explain" is handed to the explain CLI untouched.
    rest: list[str] | None = None
    if "explain" in argv:
        cut = argv.index("explain") + 1
        argv, rest = argv[:cut], argv[cut:]
    args = build_parser().parse_args(argv)
    if rest is not None:
        args.rest = rest
    logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose or
                        args.command == "run" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lean_pyroute2()  # before any command imports it (util/lean_import.py)
    try:
        rc = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed stdout fails here, not at exit where it would print a traceback
        return rc
    except BrokenPipeError:  # stdout closed by the reader (`| head`): done, quietly; before
        # ConnectionError, its base class, which means the agent
        _stdout_to_devnull()
        return 0
    except ConfigError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    except (urllib.error.URLError, ConnectionError) as err:
        print(f"usproxy: cannot reach the agent: {err}", file=sys.stderr)
        return 1
    except (SourceError, AlreadyRunning, CannotRun) as err:
        text = str(err)  # "usproxy run: ..." names usproxy already
        print(text if text.startswith("usproxy") else f"usproxy: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
