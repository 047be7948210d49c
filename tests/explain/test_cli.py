"""`usproxy explain` end to end: every view in order, exit codes for bad input and --live.

The --live tests read only what they create: an agent stub of their own (or a port nothing
listens on), no nftables table (the read is replaced), and an empty BPF pin root of their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.explain.conftest import FIXTURES, dead_address
from usproxy.app import cli as top
from usproxy.util.errors import ConfigError
from usproxy.explain import cli, live
from usproxy.offload.bpf import view


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_all_views_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--services", str(FIXTURES), "--mode", "all", "--node-ip", "192.168.0.2",
                      "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"], capsys)
    assert rc == 0
    heads = [line for line in out.splitlines() if line.startswith("==== ")]
    assert [h.split()[1] for h in heads] == ["1.", "2.", "3.", "4.", "5.", "6."]
    for marker in ("KUBE-PORTALS-CONTAINER", "*nat", "IP Virtual Server", "table ip kube-proxy",
                   "table ip6 kube-proxy", "SERVICE ADDRESS", "REALLY GETS"):
        assert marker in out


def test_one_mode(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--services", str(FIXTURES / "clusterip.yaml"), "--mode", "nftables",
                      "--nft-format", "dump"], capsys)
    assert rc == 0 and "add rule ip kube-proxy" in out and "KUBE-SVC-" not in out


def test_html_writes_one_self_contained_file_with_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "view.html"
    rc, out, _ = run(["--services", str(FIXTURES / "clusterip.yaml"), "--html", str(page)], capsys)
    text = page.read_text()
    assert rc == 0 and str(page) in out
    assert text.count("<svg") >= 5  # one drawing per mode at least
    for mode in ("userspace", "iptables", "ipvs", "nftables", "bpf"):
        assert f"<h3>{mode}: " in text, mode
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text  # nothing fetched


def test_trace_subcommand_through_the_top_level_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = top.main(["explain", "trace", "10.244.9.9", "10.96.1.1:80/TCP",
                   "--services", str(FIXTURES / "clusterip.yaml"), "--mode", "iptables", "--detail"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("=> DNAT to") == 3


def test_bad_manifest_exits_2_naming_object_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: b}\n"
                   "spec: {clusterIP: 10.96.0.1, ports: [{port: 99999}]}\n")
    rc = top.main(["explain", "trace", "10.0.0.1", "10.96.0.1:80/TCP", "--services", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "Service a/b" in err and "spec.ports[0].port" in err


@pytest.mark.parametrize("argv", [
    ["--kubeconfig", "/nonexistent"],
    ["--services", "/nonexistent/dir"],
    ["--services", str(FIXTURES), "--node-ip", "not-an-ip"],
])
def test_bad_usage_is_a_config_error(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        cli.main(argv)


def test_live_without_agent_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                    own_pin_root: Path) -> None:
    addr = dead_address()
    monkeypatch.setattr(live, "nft_tables", lambda: [])
    rc, _, err = run(["--live", "--metrics-bind-address", addr], capsys)
    assert rc == 1 and "nothing to show" in err


def test_live_reads_pins_under_the_root_it_is_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[Path | None] = []

    def render_pinned(pin_root: Path | None = None) -> str:
        asked.append(pin_root)
        return "# bpf socket LB pinned (stub)"

    monkeypatch.setattr(view, "render_pinned", render_pinned)
    monkeypatch.setattr(live, "nft_tables", lambda: [])
    text = live.read_live(dead_address(), pin_root=tmp_path / "pins")
    assert asked == [tmp_path / "pins"]
    assert text is not None and "# bpf socket LB pinned (stub)" in text


def test_live_reads_a_running_agent(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                    own_pin_root: Path) -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    rows = {"/services": [{"servicePortName": "shop/cart:http", "protocol": "TCP",
                           "clusterIPs": ["10.96.1.1"], "port": 80, "nodePort": 0,
                           "endpoints": [{"address": "10.244.1.5:8080", "usable": True}],
                           "datapath": "userspace", "reason": "new"}],
            "/flows": []}

    class Agent(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps(rows[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(live, "nft_tables", lambda: [])
    try:
        rc, out, _ = run(["--live", "--metrics-bind-address", f"127.0.0.1:{server.server_port}"], capsys)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert rc == 0
    assert "==== 1. live" in out and "shop/cart:http" in out  # the only section shown, so 1. and "0 flow entries" in out
