"""OffloadSettings: what the offload layer and the kernel datapaths take from the agent's
settings (usproxy.model.config.ProxyConfig), so they never read flags themselves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from usproxy.model.config import BpfLbAcceleration, BpfLbMode, ProxyConfig, parse_cidrs
from usproxy.model.datapath_name import OffloadMode
from usproxy.model.service_port import LBPolicy
from usproxy.model.types import IPNetwork
from usproxy.offload.bpf.map_sizes import MapSizeFlags


@dataclass(frozen=True, slots=True)
class OffloadSettings:
    """What the offload layer takes from the agent's settings: which kernel datapaths
    (--offload), the window (--offload-after, seconds), the default lb-policy and the cgroup the
    BPF socket LB attaches to."""

    mode: OffloadMode
    offload_after: float
    lb_policy: LBPolicy
    bpf_cgroup: Path
    service_cidrs: tuple[IPNetwork, ...] = ()  # --service-cidr
    vip_interface: str = "usproxy0"  # its addresses never serve NodePorts
    bpf_lb_mode: BpfLbMode = "snat"  # --bpf-lb-mode: NodePorts at tc with SNAT or DSR
    bpf_lb_acceleration: BpfLbAcceleration = "disabled"  # --bpf-lb-acceleration: "native" adds XDP to tc
    iptables_localhost_nodeports: bool = True  # iptables.localhostNodePorts
    bpf_map_sizes: MapSizeFlags = MapSizeFlags()  # --bpf-map-dynamic-size-ratio and the per-map flags
    bpf_enable_tcx: bool = True  # --enable-tcx
    hairpin_mark: int = 0  # --hairpin-mark: the conntrack mark of LB hairpins (relay/return_route.py)

    @classmethod
    def from_config(cls, cfg: ProxyConfig) -> OffloadSettings:
        return cls(cfg.offload, cfg.offload_after, cfg.lb_policy, cfg.bpf_cgroup,
                   parse_cidrs(cfg.service_cidrs, "--service-cidr"), cfg.vip_interface, cfg.bpf_lb_mode,
                   cfg.bpf_lb_acceleration, cfg.iptables_localhost_nodeports, map_size_flags(cfg), cfg.enable_tcx,
                   cfg.hairpin_mark)


def map_size_flags(cfg: ProxyConfig) -> MapSizeFlags:
    """The BPF map sizing flags of `cfg` (usproxy/offload/bpf/map_sizes.py)."""
    return MapSizeFlags(cfg.bpf_map_dynamic_size_ratio, cfg.bpf_ct_global_tcp_max, cfg.bpf_ct_global_any_max,
                        cfg.bpf_sock_rev_map_max, cfg.bpf_lb_map_max, cfg.bpf_lb_affinity_map_max,
                        cfg.bpf_fragments_map_max)
