"""The README's screenshots (docs/page-*.png, docs/view-*.png), taken as a person sees the pages.

Headless Chromium (tests/browser.py) at 1400x1000 and at 800x1000 shows:
- the page `usproxy explain --services examples/ --html` writes (docs/page-1400.png, page-800.png);
- the live page of an agent serving examples/ with nftables offload in a throwaway lab
  (tests/netns.py: a node namespace with the examples' pods, and a client holding one connection
  open): its first screen (docs/view-1400.png, view-800.png) and the path of a connection to
  default/web, with usproxy's own nftables table beside kube-proxy's (docs/view-paths-1400.png).

Run as root after scripts/setup.sh: `.venv/bin/python scripts/screenshots.py [OUT_DIR]` (default
docs/). Colours are reduced to a palette with `pngquant` where it is installed (`apt-get install
pngquant`), so the PNGs stay small. The lab, the agent, its nftables table and the browser go away at the end,
also on failure.
"""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.browser import Browser  # noqa: E402
from tests.netns import Topology, inside  # noqa: E402
from tests.offload.harness import Pods  # noqa: E402
from tests.relay.harness import AgentProc, Manifests  # noqa: E402

USPROXY = str(ROOT / ".venv" / "bin" / "usproxy")
EXAMPLES = ROOT / "examples" / "services.yaml"
PODS = {"web-1": "10.244.1.10", "web-2": "10.244.2.10", "web-3": "10.244.3.10"}
WIDTHS = (1400, 800)
HEIGHT = 1000


def shoot(browser: Browser, width: int, path: Path, top: float = 0) -> None:
    """The window's view from `top` (page pixels), `width` x HEIGHT, as a PNG at `path`."""
    data = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                        clip={"x": 0, "y": top, "width": width, "height": HEIGHT, "scale": 1}, session=True)["data"]
    path.write_bytes(base64.b64decode(data))
    if shutil.which("pngquant"):  # a palette: a third of the size, no visible change
        subprocess.run(["pngquant", "--force", "--quality=60-90", "--speed=1", "--output", str(path), str(path)],
                       check=True)
    print(f"{path}: {path.stat().st_size // 1024} KiB")


def page(out: Path, ns: str, work: Path) -> None:
    html = work / "examples.html"
    subprocess.run([USPROXY, "explain", "--services", str(EXAMPLES), "--html", str(html)], check=True)
    for width in WIDTHS:
        b = Browser(ns, width, HEIGHT)
        try:
            b.goto(html.as_uri())
            b.wait("!!document.querySelector('details.service[open] svg')", timeout=20)
            shoot(b, width, out / f"page-{width}.png")
        finally:
            b.close()


def wait_offloaded(agent: AgentProc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r["datapath"] == "nftables" for r in agent.get("/services")):
            return
        time.sleep(0.2)
    raise RuntimeError("the examples' Services were not offloaded to nftables")


def view(out: Path, topo: Topology) -> None:
    url = "http://127.0.0.1:10249/view"
    for width in WIDTHS:
        b = Browser(topo.node, width, HEIGHT)
        try:
            b.goto(url)
            b.wait("document.querySelectorAll('#events li').length >= 5", timeout=20, what="the offload events")
            b.wait("document.querySelectorAll('#flows tbody tr').length >= 1", timeout=20, what="the client's flow")
            b.wait("!!document.querySelector('details.service[open] .mode')", timeout=20, what="the first drawings")
            time.sleep(1)  # the row highlights of the first snapshot fade
            shoot(b, width, out / f"view-{width}.png")
            if width != WIDTHS[0]:
                continue
            web = "document.querySelector('details[data-service=\"default/web\"]')"
            b.eval("document.querySelectorAll('details.service[open]').forEach(d => d.open = false)")
            b.eval(f"{web}.open = true")
            b.wait(f"!!{web}.querySelector('.mode[data-mode=nftables] .drawing.live g.backend')", timeout=20)
            top = b.eval(f"{web}.querySelector('.mode[data-mode=nftables]').getBoundingClientRect().top + scrollY - 8")
            shoot(b, width, out / "view-paths-1400.png", top)
        finally:
            b.close()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    with tempfile.TemporaryDirectory(prefix="usproxy-shots-") as tmp:
        work = Path(tmp)
        topo = Topology()
        pods = Pods(topo, work)
        agent: AgentProc | None = None
        try:
            topo.build_node()
            for name, ip in PODS.items():
                pods.add(name, ip)
            client = topo.add_host("client", "10.244.9.9")
            manifests = Manifests(work / "manifests")
            shutil.copy(EXAMPLES, manifests.path)
            agent = AgentProc(topo, manifests, "uvloop", "--offload", "nftables", "--offload-after", "2",
                              "--hostname-override", "node-a")
            agent.start()
            wait_offloaded(agent)
            with inside(client):
                conn = socket.create_connection(("10.96.10.10", 80), timeout=5)  # one flow on the page
            try:
                conn.recv(64)
                view(out, topo)
            finally:
                conn.close()
            page(out, topo.node, work)
        finally:
            if agent is not None:
                agent.stop()
                subprocess.run(["ip", "netns", "exec", topo.node, USPROXY, "run", "--cleanup"], capture_output=True)
            pods.close()
            topo.close()


if __name__ == "__main__":
    main()
