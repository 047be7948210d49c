"""ModeView: one set of Services as each proxy mode holds it, for the web view's /view/service and
the standalone page (`usproxy explain --html`): per mode its title, the rules it renders and the
SVG path drawings.

The agent's web view imports this module only when a page asks for a Service (it loads the whole
of usproxy.explain, ~4 MiB of RSS), never at start. Invariant: a pure function of its input.
"""

from __future__ import annotations

from typing import TypedDict

from usproxy.explain import path_drawing
from usproxy.explain.registry import MODES
from usproxy.model.service_set import ServiceSet


class ModeViewRow(TypedDict):
    """One mode in /view/service's JSON: its name, its title, the text of its rules, and one SVG
    drawing per ServicePort and IP family."""

    mode: str
    title: str
    rules: str
    svgs: list[str]


def mode_views(ss: ServiceSet) -> list[ModeViewRow]:
    """Per mode (registry order): its name, title, the rules usproxy.explain renders for `ss`,
    and one drawing per ServicePort and IP family."""
    fps = [fp for family in ss.families() for fp in ss.family_ports(family)]
    return [{"mode": m.name, "title": m.title, "rules": m.render(ss),
             "svgs": [path_drawing.render(m.drawing.of(fp), m.name) for fp in fps]}
            for m in MODES]
