"""StandalonePage: the web view's drawings and rules for a set of Services as one self-contained
HTML file, for people without a running agent (`usproxy explain --html FILE`).

In order: the introduction (page_sections.intro_html), per Service and per mode the SVG of the path
a new connection takes next to the rules usproxy.explain renders for that Service (the same content
as the live page's "path of a connection" section, mode_view.mode_views; Services with a usable
endpoint first, the first one open), "why, in numbers" (page_sections.numbers_html), and the plots
of a tour's results directory when one is given. Self-contained: the stylesheet
(usproxy/explain/static/explain.css, which the live page links too) is inlined, the drawings are
inline SVG, plots are data: URIs, and there is no script and no link to any other file, so it opens
from disk as it is. Invariant: a pure function of its input (and of the results directory's files).
"""

from __future__ import annotations

from html import escape
from importlib import resources
from pathlib import Path

from usproxy.explain import page_sections
from usproxy.explain.mode_view import mode_views
from usproxy.model.service_set import ServiceSet

TITLE = "usproxy explain: the path of a connection, in each mode"


def stylesheet() -> str:
    """usproxy/explain/static/explain.css (package data): the page and the drawings' styles."""
    return resources.files("usproxy.explain").joinpath("static", "explain.css").read_text(encoding="utf-8")


def _service(name: str, ss: ServiceSet, opened: bool) -> str:
    parts = [f'<details class="service" data-service="{escape(name)}"{" open" if opened else ""}>'
             f"<summary>{escape(name)}</summary>"]
    for m in mode_views(ss):
        parts.append(f'<div class="mode" data-mode="{m["mode"]}"><h3>{escape(m["title"])}</h3>'
                     f'<div class="drawing">{"".join(m["svgs"])}</div>'
                     f'<pre class="rules">{escape(m["rules"])}</pre></div>')
    return "\n".join(parts + ["</details>"])


def render(ss: ServiceSet, title: str = TITLE, generated: int | None = None, tour: Path | None = None) -> str:
    """The HTML document (text) for every Service of `ss`; `generated`: also measure "why, in
    numbers" at that many Services generated like these; `tour`: a results directory whose plots
    are shown."""
    services = [_service(name, ServiceSet(tuple(ports), ss.node), i == 0)
                for i, (name, ports) in enumerate(page_sections.services_in_order(ss))]
    body = "\n".join(services) or "<p>No Services to show.</p>"
    plots = page_sections.tour_html(tour) if tour is not None else None
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{escape(title)}</title>\n<style>\n{stylesheet()}</style>\n</head>\n<body>\n"
            f"<header><h1>{escape(title)}</h1></header>\n<main>\n{page_sections.intro_html()}"
            '<section class="paths">\n<h2>The path of a connection, in each mode</h2>\n'
            f"{body}\n</section>\n{page_sections.numbers_html(ss, generated, anchor='numbers')}{plots or ''}"
            "</main>\n</body>\n</html>\n")
