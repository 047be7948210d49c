"""The live page in a real browser: headless Chromium in the node namespace loads /view from a
real agent (relay + nftables offload) and the test reads what a person would see: the introduction,
the Services listed, a relay flow appearing within a second of a connection opening and leaving
after it closes, the ServicePort's datapath turning from userspace to nftables once --offload-after
has passed (with the event worded as what happened) and a kernel conntrack flow listed, a drawing
for every one of the five modes next to its rules, the first Service shown and opened being one
with endpoints, usproxy's own nftables table drawn from what the kernel lists next to kube-proxy's,
an endpoint removed and added back and one turned not ready and ready again highlighted in its row
and drawings, and the page's words for a demotion and for relayed flows of a BPF ServicePort.
Screenshots are kept in the test's tmp dir (printed), never in the repo."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import Browser
from tests.netns import Topology, inside
from tests.offload.harness import Pods, wait_listening
from tests.relay.harness import AgentProc, Manifests, slice_, svc

# No skip when chromium is missing: the README's test command installs it, so a missing browser is a
# failed set-up and must fail here (Browser asserts it) rather than pass CI silently.
pytestmark = [pytest.mark.netns]

VIP = "10.96.10.10"
URL = "http://127.0.0.1:10249/view"
OFFLOAD_AFTER = 4  # seconds: long enough to see the relay serve first


def services(eps: list[str], not_ready: tuple[str, ...] = ()) -> list[dict[str, object]]:
    port = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    return [svc("alpha", "10.96.1.1", port),  # no endpoints, and first by name
            svc("web", VIP, port),
            slice_("web", [{"ip": e, "ready": e not in not_ready} for e in eps],
                   [{"name": "http", "port": 8080, "protocol": "TCP"}]),
            svc("dns", "10.96.0.10", [{"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}], namespace="kube-system"),
            slice_("dns", [{"ip": eps[0], "ready": True}], [{"name": "dns", "port": 8080, "protocol": "UDP"}],
                   namespace="kube-system")]


def cell(spn: str, column: str) -> str:
    """JavaScript: the text of one column of one ServicePort's row ('' when absent)."""
    return (f"(document.querySelector('#services tr[data-spn={json.dumps(spn)}] td.{column}') || "
            "{textContent: ''}).textContent")


@pytest.fixture
def browser(topology: Topology) -> Iterator[Browser]:
    b = Browser(topology.node)
    try:
        yield b
    finally:
        b.close()


def test_the_page_shows_services_flows_offload_and_drawings(
        topology: Topology, pods: Pods, tmp_path: Path, browser: Browser) -> None:
    pods.add("a", "10.244.1.1")
    pods.add("b", "10.244.2.1")
    client = topology.add_host("client", "10.244.9.9")
    m = Manifests(tmp_path / "manifests")
    m.write(*services(["10.244.1.1", "10.244.2.1"]))
    agent = AgentProc(topology, m, "uvloop", "--offload", "nftables", "--offload-after", str(OFFLOAD_AFTER),
                      "--min-sync-period", "200ms")
    agent.start()
    try:
        browser.goto(URL)
        browser.wait("document.querySelectorAll('#services tbody tr').length === 3", what="the ServicePorts listed")
        names = browser.eval("[...document.querySelectorAll('#services tbody tr')].map(r => r.dataset.spn)")
        assert names == ["default/alpha:http", "default/web:http", "kube-system/dns:dns"]
        assert "is a stable address" in browser.eval("document.querySelector('#intro').textContent")
        # the drawings start with a Service a connection can reach: default/web, opened; alpha last
        browser.wait("document.querySelectorAll('#paths > details').length === 3", what="three Services drawn")
        drawn = browser.eval("[...document.querySelectorAll('#paths > details')].map(d => [d.dataset.service, d.open])")
        assert drawn == [["default/web", True], ["kube-system/dns", False], ["default/alpha", False]], drawn
        assert browser.eval(cell("default/web:http", "datapath")) == "userspace"
        assert "10.96.10.10:80/TCP" in browser.eval("document.querySelector('#services tbody').textContent")
        wait_listening(client, VIP, 80)

        # A relay flow: in the table within a second of the connection opening, gone after it closes.
        flows = "document.querySelectorAll('#flows tbody tr').length"
        browser.wait(f"{flows} === 0", what="no flow left by wait_listening")
        with inside(client):
            conn = socket.create_connection((VIP, 80), timeout=3)
        try:
            conn.recv(64)
            seen = browser.wait(f"{flows} === 1", timeout=1.0, what="the open connection's flow")
            row = browser.eval("document.querySelector('#flows tbody tr').textContent")
            assert "userspace" in row and "default/web:http" in row and "10.244.9.9" in row, row
        finally:
            conn.close()
        browser.wait(f"{flows} === 0", timeout=3.0, what="the flow leaving after close")
        browser.screenshot(tmp_path / "web-view-userspace.png")

        # Offload: the datapath cell turns to nftables and the event is listed.
        browser.wait(f"{cell('default/web:http', 'datapath')} === 'nftables'", timeout=OFFLOAD_AFTER + 4,
                     what="default/web:http offloaded to nftables")
        browser.wait("document.querySelector('#events').textContent.includes('default/web:http offloaded to "
                     "nftables: its endpoints held still for --offload-after')", what="the offload event, in words")
        with inside(client):
            conn = socket.create_connection((VIP, 80), timeout=3)
        try:  # now a kernel conntrack flow, as /flows lists it
            conn.recv(64)
            browser.wait("[...document.querySelectorAll('#flows tbody tr')].some(r => "
                         "r.textContent.startsWith('nftables') && r.textContent.includes('10.244.9.9'))",
                         timeout=2.0, what="the connection's kernel conntrack flow")
        finally:
            conn.close()

        # A drawing and the rules for every mode, for every Service: a closed one is drawn when opened.
        dns = "document.querySelector('details[data-service=\"kube-system/dns\"]')"
        assert browser.eval(f"{dns}.querySelectorAll('.mode').length") == 0
        browser.eval(f"{dns}.open = true")
        browser.wait(f"{dns}.querySelectorAll('.mode').length === 5", what="kube-system/dns drawn once opened")
        for service in ("default/web", "kube-system/dns"):
            modes = browser.eval(f"[...document.querySelectorAll('details[data-service=\"{service}\"] .mode')]"
                                 ".map(m => [m.dataset.mode, m.querySelectorAll('.drawing:not(.live) svg.path g.backend').length, "
                                 "m.querySelector('pre.rules').textContent.length > 0])")
            assert [mo[0] for mo in modes] == ["userspace", "iptables", "ipvs", "nftables", "bpf"], service
            want_backends = 2 if service == "default/web" else 1
            assert all(n == want_backends and rules for _, n, rules in modes), modes
        iptables_rules = browser.eval("document.querySelector('details[data-service=\"default/web\"] "
                                      ".mode[data-mode=iptables] pre').textContent")
        assert "KUBE-SVC-" in iptables_rules and "--probability 0.5" in iptables_rules

        # usproxy's own table, beside kube-proxy's: what `nft list table ip usproxy` lists now
        listed = subprocess.run(["nsenter", f"--net=/run/netns/{topology.node}", "nft", "list", "table", "ip",
                                 "usproxy"], capture_output=True, text=True, check=True).stdout
        browser.wait("document.querySelectorAll('details[data-service=\"default/web\"] .mode[data-mode=nftables] "
                     ".drawing.live g.backend').length === 2", timeout=5, what="usproxy's own table drawn")
        live = browser.eval("document.querySelector('details[data-service=\"default/web\"] "
                            ".mode[data-mode=nftables] pre.live').textContent")
        element = re.search(r'10\.96\.10\.10 \. tcp \. 80 comment "default/web:http/TCP" : goto [\w-]+', listed)
        assert element is not None, listed
        assert element[0] in live and "10.96.10.10 . tcp . 80 : 10.244.2.1 . 8080" in live, live
        assert not browser.eval("document.querySelector('.mode[data-mode=iptables] .live')")

        # An endpoint removed: shown struck out in its row, and the drawings redrawn with one backend.
        m.write(*services(["10.244.1.1"]))
        browser.wait("document.querySelector('#services tr[data-spn=\"default/web:http\"] .ep.removed')"
                     "?.textContent === '10.244.2.1:8080'", timeout=3.0, what="the removed endpoint highlighted")
        browser.wait("document.querySelectorAll('details[data-service=\"default/web\"] "
                     ".mode[data-mode=nftables] .drawing:not(.live) g.backend').length === 1", what="the drawing redrawn")
        browser.wait("document.querySelectorAll('details[data-service=\"default/web\"] "
                     ".mode[data-mode=nftables] .drawing.live g.backend').length === 1",
                     what="usproxy's table redrawn as the kernel lists it after the change")
        browser.screenshot(tmp_path / "web-view-removed.png")
        # ... and added back: highlighted in its row and in every mode's drawing.
        m.write(*services(["10.244.1.1", "10.244.2.1"]))
        browser.wait("document.querySelector('#services tr[data-spn=\"default/web:http\"] .ep.added')"
                     "?.textContent === '10.244.2.1:8080'", timeout=3.0, what="the added endpoint highlighted")
        browser.wait("document.querySelectorAll('details[data-service=\"default/web\"] "
                     "g.backend.added[data-endpoint=\"10.244.2.1:8080\"]').length >= 5",
                     what="the added backend highlighted in all five drawings")
        shot = browser.screenshot(tmp_path / "web-view.png")

        # A readiness-only change: the endpoint stays listed, marked as it turns not ready...
        m.write(*services(["10.244.1.1", "10.244.2.1"], not_ready=("10.244.2.1",)))
        turned = ("document.querySelector('#services tr[data-spn=\"default/web:http\"] .ep.readiness')")
        browser.wait(f"{turned}?.title === 'just became not ready'", timeout=3.0, what="not ready, highlighted")
        assert browser.eval(f"{turned}.classList.contains('unusable')")
        # ... and ready again: marked in its row, and back in the drawings, highlighted
        m.write(*services(["10.244.1.1", "10.244.2.1"]))
        browser.wait(f"{turned}?.title === 'just became ready'", timeout=3.0, what="ready again, highlighted")
        browser.wait("document.querySelectorAll('details[data-service=\"default/web\"] "
                     "g.backend.added[data-endpoint=\"10.244.2.1:8080\"]').length >= 5",
                     what="the endpoint ready again highlighted in the drawings")

        # The page's words for a demotion and for relayed flows of a BPF ServicePort (its own code)
        demoted = browser.eval("eventText({kind: 'demoted', servicePortName: 'default/web:http', datapath: "
                               "'userspace', reason: 'demoted: nftables: refused the transaction (errno 22)'})")
        assert demoted == ("default/web:http demoted, back to the relay: nftables: refused the transaction "
                           "(errno 22); it is tried again once its endpoints have held still for another "
                           "--offload-after")
        why = browser.eval("reasonCell({servicePortName: 'default/web:http', protocol: 'TCP', datapath: 'bpf', "
                           "reason: 'established'}, new Map([['default/web:http/TCP', 2]])).textContent")
        assert why.startswith("established2 relayed flows: the BPF socket LB rewrites connect() only for "
                              "processes inside its cgroup (--bpf-cgroup)"), why
        print(f"screenshots: {shot.parent}")
        assert seen < 1.0
    finally:
        agent.stop()
