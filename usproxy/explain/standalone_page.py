"""StandalonePage: the web view's drawings and rules for a set of Services as one self-contained
HTML file, for people without a running agent (`usproxy explain --html FILE`).

The same content as the live page's "path of a connection" section (mode_view.mode_views): per
Service, per mode, the SVG of the path a new connection takes and the rules usproxy.explain renders
for that Service. Self-contained: the stylesheet (usproxy/explain/static/explain.css, which the live
page links too) is inlined, the drawings are inline SVG, and there is no script and no link to any
other file, so it opens from disk as it is. Invariant: a pure function of its input.
"""

from __future__ import annotations

from html import escape
from importlib import resources

from usproxy.explain.mode_view import mode_views
from usproxy.model.service_set import ServiceSet
from usproxy.model.endpoint import Endpoint
from usproxy.model.service_port import ServicePort


def stylesheet() -> str:
    """usproxy/explain/static/explain.css (package data): the page and the drawings' styles."""
    return resources.files("usproxy.explain").joinpath("static", "explain.css").read_text(encoding="utf-8")


def _by_service(ss: ServiceSet) -> dict[str, list[tuple[ServicePort, tuple[Endpoint, ...]]]]:
    out: dict[str, list[tuple[ServicePort, tuple[Endpoint, ...]]]] = {}
    for sp, eps in ss.ports:
        out.setdefault(f"{sp.name.namespace}/{sp.name.name}", []).append((sp, eps))
    return out


def _service(name: str, ss: ServiceSet) -> str:
    parts = [f'<details class="service" data-service="{escape(name)}" open><summary>{escape(name)}</summary>']
    for m in mode_views(ss):
        parts.append(f'<div class="mode" data-mode="{m["mode"]}"><h3>{escape(m["title"])}</h3>'
                     f'<div class="drawing">{"".join(m["svgs"])}</div>'
                     f'<pre class="rules">{escape(m["rules"])}</pre></div>')
    return "\n".join(parts + ["</details>"])


def render(ss: ServiceSet, title: str = "usproxy explain: the path of a connection, in each mode") -> str:
    """The HTML document (text) for every Service of `ss`, in ServicePortName order."""
    services = [_service(name, ServiceSet(tuple(ports), ss.node)) for name, ports in _by_service(ss).items()]
    body = "\n".join(services) or "<p>No Services to show.</p>"
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>\n{stylesheet()}</style>\n</head>\n<body>\n<header><h1>{escape(title)}</h1></header>\n"
            "<main>\n<p class=\"sub\">The first packet walks these rules; later packets and replies ride "
            "conntrack (the relay has its own flow table).</p>\n"
            f"{body}\n</main>\n</body>\n</html>\n")
