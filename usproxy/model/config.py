"""ProxyConfig: the agent's settings from flags and a KubeProxyConfiguration file.

`--config FILE` reads kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration for the fields
usproxy understands (listed in KNOWN_FIELDS) and warns, naming them, about the rest; flags given on
the command line override the file. Durations use Go's form ("30s", "1m0s", "250ms").
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from usproxy.model.types import IPNetwork, parse_cidr_sloppy
from usproxy.model.datapath_name import OffloadMode
from usproxy.util import cgroup2
from usproxy.util.errors import ConfigError
from usproxy.model.service_port import LBPolicy

log = logging.getLogger(__name__)

BpfLbMode = Literal["snat", "dsr"]
BPF_LB_MODES: tuple[BpfLbMode, ...] = ("snat", "dsr")
BpfLbAcceleration = Literal["native", "disabled"]  # native: NodePorts at XDP too (Cilium's flag)


@dataclass(frozen=True)
class ProxyConfig:
    """Every setting of `usproxy run`. Times in seconds."""

    services: Path | None = None
    kubeconfig: Path | None = None
    offload: OffloadMode = "auto"
    offload_after: float = 5.0
    healthz_bind_address: str = "0.0.0.0:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    hostname_override: str | None = None
    nodeport_addresses: tuple[str, ...] = ()  # CIDRs, or ("primary",): see parse_nodeport_addresses
    service_cidrs: tuple[str, ...] = ()  # the cluster's Service CIDRs (--service-cidr)
    vip_interface: str = "usproxy0"
    # the packet and conntrack mark bit of answers to LB hairpins (usproxy/relay/return_route.py); 0: off
    hairpin_mark: int = 0x1000  # return_route.DEFAULT_MARK (model imports nothing above it)
    lb_policy: LBPolicy = "roundRobin"
    sync_period: float = 30.0
    min_sync_period: float = 0.25
    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    udp_idle_timeout: float = 30.0
    # idle timeouts of relayed TCP flows: kube-proxy's conntrack flags for the kernel's entries
    tcp_established_timeout: float = 86400.0
    tcp_close_wait_timeout: float = 3600.0
    # where the mount table puts cgroup v2: /sys/fs/cgroup alone, /sys/fs/cgroup/unified hybrid
    bpf_cgroup: Path = field(default_factory=cgroup2.mount_point)
    # NodePorts at tc with a backend on another node: SNAT, or direct server return (Cilium's
    # bpf-lb-mode; usproxy/offload/bpf/dsr.h)
    bpf_lb_mode: BpfLbMode = "snat"
    bpf_lb_acceleration: BpfLbAcceleration = "disabled"
    # BPF map sizes (usproxy/offload/bpf/map_sizes.py), Cilium's flags: 0 = sized to the memory
    bpf_map_dynamic_size_ratio: float = 0.0025
    bpf_ct_global_tcp_max: int = 0
    bpf_ct_global_any_max: int = 0
    bpf_sock_rev_map_max: int = 0
    bpf_lb_map_max: int = 65536
    bpf_lb_affinity_map_max: int = 0
    bpf_fragments_map_max: int = 8192
    # the tc programs attach with tcx where the kernel has it; false: a clsact qdisc's cls_bpf
    # filters even there (Cilium's enable-tcx)
    enable_tcx: bool = True
    # how the relay captures a frontend whose port another local socket holds (relay/port_capture.py)
    relay_capture: str = "auto"
    cleanup: bool = False
    # local-traffic detection and masquerade, as kube-proxy (usproxy/model/local_detector.py)
    detect_local_mode: str = "ClusterCIDR"
    cluster_cidrs: tuple[str, ...] = ()
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    masquerade_all: bool = False
    tour_results: Path | None = None  # a tour's results directory: its plots in the web view
    # kube-proxy's iptables.localhostNodePorts: the iptables datapath serves NodePorts on 127.0.0.1
    # (it sets route_localnet) where every IPv4 address serves NodePorts
    iptables_localhost_nodeports: bool = True

    def conntrack_max(self, cores: int | None = None) -> int:
        """kube-proxy's rule: max(maxPerCore × cores, min); 0 per core means min alone."""
        cores = cores or os.cpu_count() or 1
        return max(self.conntrack_max_per_core * cores, self.conntrack_min)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: object, where: str) -> float:
    """Go duration text (or a number of seconds) → seconds. Raises ConfigError naming `where`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if text == "0":  # Go's time.ParseDuration takes a bare 0
        return 0.0
    if not isinstance(text, str) or not text or _DURATION.sub("", text):
        raise ConfigError(f"not a duration: {text!r}", field=where)
    return sum(float(n) * _UNIT[u] for n, u in _DURATION.findall(text))


PRIMARY = "primary"  # kube-proxy's special --nodeport-addresses value (NodePortAddressesPrimary)


def parse_cidrs(texts: tuple[str, ...], where: str) -> tuple[IPNetwork, ...]:
    """CIDR texts -> networks (host bits allowed, as kube-proxy's ParseCIDRSloppy; a bare
    address is refused as kube-proxy's validation does: "must be a valid CIDR"). Raises
    ConfigError naming `where` and the bad entry."""
    out = []
    for text in texts:
        try:
            if "/" not in text:
                raise ValueError("must be a CIDR (address/prefix length)")
            out.append(parse_cidr_sloppy(text))
        except ValueError as err:  # ipaddress's own message names the value already
            said = str(err)
            raise ConfigError(said if repr(text) in said else f"{text!r}: {said}", field=where) from None
    return tuple(out)


def parse_nodeport_addresses(texts: tuple[str, ...], where: str = "--nodeport-addresses") -> tuple[IPNetwork, ...] | None:
    """--nodeport-addresses: CIDRs, or None for the single value "primary" (the node's primary
    addresses, resolved by usproxy.model.node). As kube-proxy (pkg/proxy/apis/config/validation
    validateNodePortAddresses): "primary" only alone, every other entry a CIDR. Raises
    ConfigError naming `where`."""
    if PRIMARY in texts:
        if len(texts) != 1:
            raise ConfigError(f"{PRIMARY!r} must be the only value, got {','.join(texts)}", field=where)
        return None
    return parse_cidrs(texts, where)


# KubeProxyConfiguration path -> (ProxyConfig field, converter)
KNOWN_FIELDS: dict[str, str] = {
    "healthzBindAddress": "healthz_bind_address",
    "metricsBindAddress": "metrics_bind_address",
    "hostnameOverride": "hostname_override",
    "nodePortAddresses": "nodeport_addresses",
    "clientConnection.kubeconfig": "kubeconfig",
    "syncPeriod": "sync_period",
    "minSyncPeriod": "min_sync_period",
    "iptables.syncPeriod": "sync_period",
    "iptables.minSyncPeriod": "min_sync_period",
    "nftables.syncPeriod": "sync_period",
    "nftables.minSyncPeriod": "min_sync_period",
    "conntrack.maxPerCore": "conntrack_max_per_core",
    "conntrack.min": "conntrack_min",
    "conntrack.udpTimeout": "udp_idle_timeout",
    "udpIdleTimeout": "udp_idle_timeout",  # kube-proxy's userspace mode (before 1.26): the relay's
    "conntrack.tcpEstablishedTimeout": "tcp_established_timeout",
    "conntrack.tcpCloseWaitTimeout": "tcp_close_wait_timeout",
    "clusterCIDR": "cluster_cidrs",
    "detectLocal.clusterCIDRs": "cluster_cidrs",
    "detectLocalMode": "detect_local_mode",
    "detectLocal.bridgeInterface": "bridge_interface",
    "detectLocal.interfaceNamePrefix": "interface_name_prefix",
    "iptables.masqueradeAll": "masquerade_all",
    "nftables.masqueradeAll": "masquerade_all",
    "linux.masqueradeAll": "masquerade_all",
    "iptables.localhostNodePorts": "iptables_localhost_nodeports",
    "mode": "offload",  # kube-proxy's proxy mode: MODES below
    "bpf.lbMode": "bpf_lb_mode",  # not kube-proxy's: Cilium's bpf-lb-mode, in the same file
}
# kube-proxy's `mode` -> --offload. Blank is kube-proxy's "best-available proxy": usproxy's ladder.
# `userspace` (kube-proxy's before 1.26) is the relay alone. kube-proxy refuses any other word, and
# so does usproxy (bpf is --offload's word only: kube-proxy has no such mode).
MODES: dict[str, OffloadMode] = {"": "auto", "iptables": "iptables", "ipvs": "ipvs", "nftables": "nftables",
                                 "userspace": "none"}
DURATIONS = ("sync_period", "min_sync_period", "udp_idle_timeout", "tcp_established_timeout",
             "tcp_close_wait_timeout")
IGNORED_QUIETLY = {"apiVersion", "kind", "bindAddress", "featureGates"}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in KNOWN_FIELDS:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _convert(name: str, key: str, value: Any) -> Any:
    if name in DURATIONS:
        return parse_duration(value, key)
    if name in ("conntrack_max_per_core", "conntrack_min"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"must be a non-negative integer, got {value!r}", field=key)
        return value
    if name == "nodeport_addresses":
        if not isinstance(value, list):
            raise ConfigError("must be a list of CIDRs", field=key)
        texts = tuple(str(v) for v in value)
        parse_nodeport_addresses(texts, key)
        return texts
    if name == "cluster_cidrs":  # v1alpha1 clusterCIDR: "a,b"; v1alpha2 detectLocal.clusterCIDRs: a list
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ConfigError("must be a comma-separated string or a list of CIDRs", field=key)
        return tuple(v.strip() for v in items if v.strip())
    if name in ("masquerade_all", "iptables_localhost_nodeports"):
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, got {value!r}", field=key)
        return value
    if name in ("detect_local_mode", "bridge_interface", "interface_name_prefix"):
        if value is None or value == "":
            return "ClusterCIDR" if name == "detect_local_mode" else ""
        if not isinstance(value, str):
            raise ConfigError(f"must be a string, got {value!r}", field=key)
        return value
    if name == "offload":
        if value is not None and (not isinstance(value, str) or value not in MODES):
            raise ConfigError(f"must be iptables, ipvs, nftables, userspace or blank (the best available: "
                              f"usproxy's ladder, --offload auto), got {value!r}", field=key)
        return MODES[value or ""]
    if name == "bpf_lb_mode":
        if value not in BPF_LB_MODES:
            raise ConfigError(f"must be one of {', '.join(BPF_LB_MODES)}, got {value!r}", field=key)
        return value
    if name == "kubeconfig":
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"must be a path, got {value!r}", field=key)
        return Path(value) if value else None
    return str(value) if value is not None else None


def load_kube_proxy_configuration(path: Path, base: ProxyConfig | None = None) -> ProxyConfig:
    """Read a KubeProxyConfiguration file over `base`. Raises ConfigError; warns on unknown fields."""
    where = f"KubeProxyConfiguration {path}"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read: {' '.join(str(err).split())}", obj=where) from None
    if not isinstance(data, dict):
        raise ConfigError("must be a YAML object", obj=where)
    if data.get("kind") not in (None, "KubeProxyConfiguration"):
        raise ConfigError(f"kind must be KubeProxyConfiguration, got {data.get('kind')!r}", obj=where)
    updates: dict[str, Any] = {}
    unknown = []
    for key, value in _flatten(data).items():
        if key in KNOWN_FIELDS:
            try:
                updates[KNOWN_FIELDS[key]] = _convert(KNOWN_FIELDS[key], key, value)
            except ConfigError as err:
                raise ConfigError(str(err), obj=where) from None
        elif key.split(".")[0] not in IGNORED_QUIETLY and value not in (None, "", [], {}):
            unknown.append(key)
    if unknown:
        log.warning("%s: fields usproxy does not use: %s", where, ", ".join(sorted(unknown)))
    return replace(base or ProxyConfig(), **updates)


def with_overrides(cfg: ProxyConfig, overrides: dict[str, Any]) -> ProxyConfig:
    """Flags given on the command line (not None) override the file."""
    names = {f.name for f in fields(ProxyConfig)}
    return replace(cfg, **{k: v for k, v in overrides.items() if k in names and v is not None})
