"""ModeView: one set of Services as each proxy mode holds it, for the web view's /view/service and
the standalone page (`usproxy explain --html`): per mode its title, the rules it renders and the
SVG path drawings.

The agent's web view imports this module only when a page asks for a Service (it loads the whole
of usproxy.explain, ~4 MiB of RSS), never at start. Invariant: a pure function of its input.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from usproxy.explain import path_drawing
from usproxy.explain.registry import MODES
from usproxy.model.service_set import ServiceSet

LIVE_TITLE = "usproxy's own table, as the kernel holds it now"


class LiveRow(TypedDict):
    """What usproxy itself holds in the kernel for the Service, in a mode it runs (nftables):
    a title, the excerpt of the kernel's listing and its drawings."""

    title: str
    rules: str
    svgs: list[str]


class ModeViewRow(TypedDict):
    """One mode in /view/service's JSON: its name, its title, the text of its rules, one SVG
    drawing per ServicePort and IP family, and where the caller read the kernel, `live`."""

    mode: str
    title: str
    rules: str
    svgs: list[str]
    live: NotRequired[LiveRow]


def mode_views(ss: ServiceSet, live: dict[int, str] | None = None) -> list[ModeViewRow]:
    """Per mode (registry order): its name, title, the rules usproxy.explain renders for `ss`,
    and one drawing per ServicePort and IP family; with `live` (usproxy's tables as the kernel
    lists them, by IP family: the running agent's), the modes usproxy runs itself add their live
    part (Mode.live_part)."""
    fps = [fp for family in ss.families() for fp in ss.family_ports(family)]
    endpoints = {str(ep): ep for fp in fps for ep in fp.endpoints}
    out: list[ModeViewRow] = []
    for m in MODES:
        row: ModeViewRow = {"mode": m.name, "title": m.title, "rules": m.render(ss),
                            "svgs": [path_drawing.render(m.drawing.of(fp), m.name) for fp in fps]}
        if live is not None and m.live_part is not None:
            rules, svgs = m.live_part(fps, live, endpoints)
            row["live"] = {"title": LIVE_TITLE, "rules": rules, "svgs": svgs}
        out.append(row)
    return out
