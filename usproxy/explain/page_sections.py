"""PageSections: the parts both pages share, the standalone page (`explain --html`) and the
agent's live page (/view): the introduction, "why, in numbers" as a table, the Services in the
order they are shown, and the tour's plots when a results directory is given.

- `intro_html()`: what a Service is, what each mode does (its record's `gist`) and how to read a
  drawing and its rules.
- `numbers_html(ss)`: "why, in numbers" measured as `explain --scale` measures it (scale.measure:
  a pod's new connection to the last Service, which sorts last in every rule list, and one
  endpoint added to it), on the Services themselves and, with `generated`, on that many
  Services generated like them, so the rules a list walks grow before the reader's eyes while
  the map lookups do not. Linear in the Services (cost.py's per-ClusterIP table is quadratic).
- `services_in_order(ss)`: Services with a usable endpoint first, so the first one a page shows
  (and opens) is one a connection can reach.
- `tour_html(dir)`: every plot (*.svg, *.png) of a results directory with its caption, in the
  order results.json lists them (the others after, by name), captions from
  results.json's "plots" list ({"file", "caption"}) where it has one; None when the directory
  holds no plot.

Invariant: pure functions of their input, except tour_html, which reads the directory it is given.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from html import escape
from pathlib import Path

from usproxy.explain import generator, scale
from usproxy.explain.mode import Mode
from usproxy.explain.registry import MODES
from usproxy.model.service_set import ServiceSet
from usproxy.model.endpoint import Endpoint, usable
from usproxy.model.service_port import ServicePort

PLOTS = (".svg", ".png")


def intro_html(modes: Sequence[Mode] = MODES) -> str:
    """The introduction, an HTML fragment."""
    items = "".join(f"<li><b>{escape(m.name)}</b>: {escape(m.gist)}</li>" for m in modes)
    return (
        '<section class="intro">\n<h2>What this page shows</h2>\n'
        "<p>A Kubernetes <b>Service</b> is a stable address, its ClusterIP and port, in front of pods that "
        "come and go: its <b>endpoints</b>. No machine owns a ClusterIP; on every node a Service proxy "
        "turns a connection to it into a connection to one endpoint. How, is the proxy's <b>mode</b>:</p>\n"
        f"<ul>{items}</ul>\n"
        "<p>Per Service, each mode has a <b>drawing</b> beside its <b>rules</b> (as <code>usproxy "
        "explain</code> prints them). A drawing follows the first packet of a new connection from left to "
        "right through the chains, maps or programs it meets (the boxes) to the endpoints, each with its "
        "share; the dashed line is the reply, with the source address the endpoint sees. Only the first "
        "packet walks rules: conntrack (or the connected socket) carries the rest. "
        '<a href="#numbers"><b>Why, in numbers</b></a> counts the rules a new connection walks and what '
        "one endpoint change makes the proxy write.</p>\n"
        "</section>\n")


def _dump(ss: ServiceSet, mode: Mode) -> str:
    """A mode's rules as `explain diff` and --scale compare them (nftables as its transaction)."""
    return mode.view(ss, "dump") if ss.ports else ""


HEADER = scale.HEADER[:-1]  # the time a measurement took says nothing about the modes


def numbers_rows(ss: ServiceSet, modes: Sequence[Mode] = MODES) -> list[list[str]]:
    """HEADER's rows for the Services of `ss` themselves."""
    return [scale.row(scale.measure(ss, m, _dump))[:len(HEADER)] for m in modes]


def _table(header: Sequence[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h.lower())}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="numbers"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def numbers_html(ss: ServiceSet, generated: int | None = None, modes: Sequence[Mode] = MODES,
                 anchor: str = "") -> str:
    """"Why, in numbers" for `ss` (and for `generated` Services generated like it), an HTML
    fragment, its section's id `anchor` if given (the introduction links to #numbers); "" when
    `ss` has no ServicePort."""
    if not ss.ports:
        return ""
    fp = scale.last_port(ss)
    n = len({sp.name.service for sp, _ in ss.ports})
    ident = f' id="{escape(anchor)}"' if anchor else ""
    out = [f'<section class="numbers"{ident}>\n<h2>Why, in numbers</h2>',
           f"<p>A pod opens a new connection to {escape(str(fp.name))}, the last of these {n} Service"
           f"{'s' * (n != 1)} in every rule list, and the modes' own tracers count the rules it walks and "
           "the lookups it makes; then one endpoint is added to it, and each mode's rules are rendered "
           "again and compared, beside what its proxy writes to the kernel for that change.</p>",
           _table(HEADER, numbers_rows(ss, modes))]
    if generated:
        big = generator.generate(ss, generated)
        out += [f"<p>The same at {generated:,} Services generated like these ({len(big.ports):,} "
                "ServicePorts): the lists grow with the Services, the maps do not.</p>",
                _table(HEADER, numbers_rows(big, modes))]
    return "\n".join([*out, "</section>\n"])


def services_in_order(ss: ServiceSet) -> list[tuple[str, list[tuple[ServicePort, tuple[Endpoint, ...]]]]]:
    """(\"ns/name\", its ServicePorts with their endpoints) per Service: those with a usable
    endpoint first, each group in name order."""
    by: dict[str, list[tuple[ServicePort, tuple[Endpoint, ...]]]] = {}
    for sp, eps in ss.ports:
        by.setdefault(str(sp.name.service), []).append((sp, eps))
    return sorted(by.items(), key=lambda kv: (not any(usable(eps) for _, eps in kv[1]), kv[0]))


def _captions(directory: Path) -> dict[str, str]:
    """results.json's {"plots": [{"file", "caption"}]}, by file name; {} when absent or unread."""
    try:
        doc = json.loads((directory / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    plots = doc.get("plots") if isinstance(doc, dict) else None
    return {str(p["file"]): str(p.get("caption", "")) for p in plots or ()
            if isinstance(p, dict) and "file" in p}


def tour_html(directory: Path) -> str | None:
    """The plots of `directory` as an HTML fragment (as data: URIs, so the page stays one
    file), each with its caption; None when it holds no plot."""
    files = sorted(p for p in directory.iterdir() if p.suffix in PLOTS and p.is_file()) if directory.is_dir() else []
    if not files:
        return None
    captions = _captions(directory)
    order = list(captions)  # results.json lists its plots in the order they are best read
    files.sort(key=lambda f: (order.index(f.name) if f.name in order else len(order), f.name))
    figures = []
    for f in files:
        mime = "image/svg+xml" if f.suffix == ".svg" else "image/png"
        data = base64.b64encode(f.read_bytes()).decode()
        figures.append(f'<figure><img alt="{escape(f.name)}" src="data:{mime};base64,{data}">'
                       f"<figcaption>{escape(captions.get(f.name, f.name))}</figcaption></figure>")
    return ('<section class="tour">\n<h2>Measured on this machine</h2>\n'
            f"<p>Plots from {escape(str(directory))}: the same Services served live by each mode.</p>\n"
            + "\n".join(figures) + "\n</section>\n")
