"""KubeProxyConfiguration loading: known fields map to ProxyConfig, unknown ones are named in a
warning, durations parse Go's form, flags override the file, bad values name the field."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import pytest

from usproxy.app.cli import build_parser, config_from_args
from usproxy.model.config import load_kube_proxy_configuration, parse_cidrs, parse_duration
from usproxy.util.errors import ConfigError

CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
healthzBindAddress: 0.0.0.0:11256
metricsBindAddress: 127.0.0.1:11249
clientConnection:
  kubeconfig: /etc/kubernetes/proxy.conf
  qps: 5
nodePortAddresses: [192.0.2.0/24]
conntrack:
  maxPerCore: 1000
  min: 5000
  udpTimeout: 45s
iptables:
  minSyncPeriod: 500ms
  syncPeriod: 1m0s
ipvs:
  scheduler: rr
"""


def test_known_fields_and_unknown_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text(CONFIG)
    with caplog.at_level(logging.WARNING):
        cfg = load_kube_proxy_configuration(f)
    assert cfg.healthz_bind_address == "0.0.0.0:11256"
    assert str(cfg.kubeconfig) == "/etc/kubernetes/proxy.conf"
    assert cfg.nodeport_addresses == ("192.0.2.0/24",)
    assert (cfg.min_sync_period, cfg.sync_period, cfg.udp_idle_timeout) == (0.5, 60.0, 45.0)
    assert cfg.conntrack_max(cores=2) == 5000 and cfg.conntrack_max(cores=8) == 8000
    assert "clientConnection.qps" in caplog.text and "ipvs.scheduler" in caplog.text


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text(CONFIG)
    args = build_parser().parse_args(["run", "--config", str(f), "--healthz-bind-address", "127.0.0.1:1",
                                      "--udp-idle-timeout", "2s"])
    cfg = config_from_args(args)
    assert cfg.healthz_bind_address == "127.0.0.1:1" and cfg.udp_idle_timeout == 2.0
    assert cfg.metrics_bind_address == "127.0.0.1:11249"


@pytest.mark.parametrize("text,seconds", [("30s", 30.0), ("1m0s", 60.0), ("250ms", 0.25), ("1h", 3600.0), (5, 5.0),
                                          ("0", 0.0)])  # Go's ParseDuration takes a bare 0
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text, "x") == seconds


def test_bad_value_names_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\nconntrack:\n  udpTimeout: soon\n")
    with pytest.raises(ConfigError, match=r"KubeProxyConfiguration .*kp.yaml: conntrack.udpTimeout: not a duration"):
        load_kube_proxy_configuration(f)


def test_a_file_that_is_not_text_is_one_error_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "kp.yaml"
    f.write_bytes(b"\x00\x01\xff\xfe")
    with pytest.raises(ConfigError, match=r"^KubeProxyConfiguration .*kp.yaml: cannot read: 'utf-8' codec can't decode"):
        load_kube_proxy_configuration(f)


def test_the_userspace_modes_udp_idle_timeout_is_read(tmp_path: Path) -> None:
    """kube-proxy's v1alpha1 udpIdleTimeout (its userspace mode's, before 1.26): the relay's."""
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\nmode: userspace\nudpIdleTimeout: 250ms\n")
    cfg = load_kube_proxy_configuration(f)
    assert cfg.udp_idle_timeout == 0.25 and cfg.offload == "none"


def test_nodeport_addresses_and_service_cidrs_name_the_flag_or_field(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    cfg = config_from_args(parse(["run", "--nodeport-addresses", "primary", "--service-cidr", "10.96.0.0/16,fd00:96::/112"]))
    assert cfg.nodeport_addresses == ("primary",) and cfg.service_cidrs == ("10.96.0.0/16", "fd00:96::/112")
    for flag, value in (("--nodeport-addresses", "primary,192.0.2.0/24"), ("--nodeport-addresses", "192.0.2.10"),
                        ("--service-cidr", "10.96.0.0/16,nope"), ("--service-cidr", "10.96.0.1")):
        with pytest.raises(ConfigError, match=f"usproxy run: {flag}: "):
            config_from_args(parse(["run", flag, value]))
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\nnodePortAddresses: [primary]\n")
    assert load_kube_proxy_configuration(f).nodeport_addresses == ("primary",)
    f.write_text("kind: KubeProxyConfiguration\nnodePortAddresses: [192.0.2.0/24, 300.1.2.3/8]\n")
    with pytest.raises(ConfigError, match=r"kp.yaml: nodePortAddresses: '300.1.2.3/8'"):
        load_kube_proxy_configuration(f)


@pytest.mark.parametrize("text, field", [
    ("clientConnection:\n  kubeconfig: 5\n", "clientConnection.kubeconfig"),
    ("conntrack:\n  maxPerCore: true\n", "conntrack.maxPerCore"),
])
def test_wrong_types_name_the_field_not_a_traceback(tmp_path: Path, text: str, field: str) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\n" + text)
    with pytest.raises(ConfigError, match=field):
        load_kube_proxy_configuration(f)


@pytest.mark.parametrize("argv, flag", [
    (["--offload-after", "nan"], "--offload-after"), (["--offload-after", "inf"], "--offload-after"),
    (["--sync-period", "0s"], "--sync-period"), (["--conntrack-min", "-1"], "--conntrack-min"),
    (["--conntrack-max-per-core", "-5"], "--conntrack-max-per-core"),
])
def test_flags_out_of_range_exit_2_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        config_from_args(build_parser().parse_args(["run", *argv]))


def test_service_cidr_with_leading_zeros_as_kube_proxy() -> None:
    cfg = config_from_args(build_parser().parse_args(["run", "--service-cidr", "010.096.000.000/16"]))
    assert parse_cidrs(cfg.service_cidrs, "--service-cidr") == (ipaddress.ip_network("10.96.0.0/16"),)


def test_bpf_lb_mode_from_file_and_flag(tmp_path: Path) -> None:
    """--bpf-lb-mode (Cilium's bpf-lb-mode): snat by default, bpf.lbMode in the file, the flag
    wins; anything else is refused."""
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\nbpf:\n  lbMode: dsr\n")
    assert config_from_args(build_parser().parse_args(["run"])).bpf_lb_mode == "snat"
    assert config_from_args(build_parser().parse_args(["run", "--config", str(f)])).bpf_lb_mode == "dsr"
    args = build_parser().parse_args(["run", "--config", str(f), "--bpf-lb-mode", "snat"])
    assert config_from_args(args).bpf_lb_mode == "snat"
    f.write_text("kind: KubeProxyConfiguration\nbpf:\n  lbMode: direct\n")
    with pytest.raises(ConfigError, match="bpf.lbMode"):
        load_kube_proxy_configuration(f)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--bpf-lb-mode", "direct"])


@pytest.mark.parametrize("mode, offload", [("iptables", "iptables"), ("ipvs", "ipvs"), ("nftables", "nftables"),
                                           ('""', "auto"), ("", "auto"), ("userspace", "none")])
def test_kube_proxys_mode_in_the_file_picks_the_datapath(tmp_path: Path, mode: str, offload: str) -> None:
    """A KubeProxyConfiguration's `mode` is --offload's default (it was ignored: `mode: ipvs` ran
    the ladder); blank is the best available, userspace the relay alone; the flag wins."""
    f = tmp_path / "kp.yaml"
    f.write_text(f"kind: KubeProxyConfiguration\nmode: {mode}\n")
    parse = build_parser().parse_args
    assert config_from_args(parse(["run", "--config", str(f)])).offload == offload
    assert config_from_args(parse(["run", "--config", str(f), "--offload", "bpf"])).offload == "bpf"


@pytest.mark.parametrize("mode", ["bogus", "bpf", "kernelspace", "[iptables]", "1"])
def test_a_mode_kube_proxy_refuses_is_refused_naming_the_field(tmp_path: Path, mode: str) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text(f"kind: KubeProxyConfiguration\nmode: {mode}\n")
    with pytest.raises(ConfigError) as err:
        load_kube_proxy_configuration(f)
    assert str(err.value).startswith(f"KubeProxyConfiguration {f}: mode: must be iptables, ipvs, nftables, "
                                     "userspace or blank"), err.value


def test_iptables_localhost_nodeports_from_file_and_flag(tmp_path: Path) -> None:
    f = tmp_path / "kp.yaml"
    f.write_text("kind: KubeProxyConfiguration\niptables:\n  localhostNodePorts: false\n")
    assert load_kube_proxy_configuration(f).iptables_localhost_nodeports is False
    parse = build_parser().parse_args
    assert config_from_args(parse(["run", "--config", str(f), "--iptables-localhost-nodeports", "true"])
                            ).iptables_localhost_nodeports is True
    f.write_text("kind: KubeProxyConfiguration\niptables:\n  localhostNodePorts: sometimes\n")
    with pytest.raises(ConfigError, match="iptables.localhostNodePorts: must be true or false"):
        load_kube_proxy_configuration(f)
