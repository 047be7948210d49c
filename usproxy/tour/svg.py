"""Plain SVG charts for the tour: lines over a (log) axis, and grouped bars.

Written by hand instead of through matplotlib: the tour runs right after set-up (which installs
no plotting library), the files are small text that the web view and `explain --html` embed as
they are, and the same input always gives the same bytes. Every plotted value is also an
attribute of its mark (`data-series`, `data-x`, `data-y` on a line's points, `data-group`,
`data-bar`, `data-value` on a bar), so a test reads a chart back and compares it with
results.json, and a reader can hover a point for its value (`<title>`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 78, 190, 46, 58  # margins: the legend sits on the right
FONT = 'font-family="sans-serif"'


@dataclass(frozen=True, slots=True)
class Series:
    """One line: `points` (x, y) in data units; `dashed` for the second kind of a mode."""

    label: str
    points: tuple[tuple[float, float], ...]
    color: str
    dashed: bool = False


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    value: float
    color: str


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    step = _nice((hi - lo) / 5 or 1)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2)]


def _nice(x: float) -> float:
    e = 10 ** math.floor(math.log10(x))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if x <= m * e:
            return float(m * e)
    return float(10 * e)


def _fmt(v: float) -> str:
    if v >= 1000 and v == int(v):
        return f"{int(v):,}"
    if v >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:g}"


class _Axis:
    def __init__(self, lo: float, hi: float, log: bool, pixels: tuple[float, float]) -> None:
        if log:
            lo, hi = max(lo, 1e-9), max(hi, lo * 10)
        elif lo == hi:
            lo, hi = lo - 1, hi + 1
        self.ticks = _ticks(lo, hi, log)
        self.lo, self.hi = (self.ticks[0], self.ticks[-1]) if log else (min(0.0, lo), self.ticks[-1])
        self.log, self.p0, self.p1 = log, pixels[0], pixels[1]

    def at(self, v: float) -> float:
        if self.log:
            f = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            f = (v - self.lo) / (self.hi - self.lo)
        return self.p0 + f * (self.p1 - self.p0)


def _frame(title: str, x_label: str, y_label: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
            f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
            f'<text x="{LEFT}" y="24" {FONT} font-size="15" font-weight="bold">{escape(title)}</text>',
            f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2}" y="{HEIGHT - 14}" {FONT} font-size="12" '
            f'text-anchor="middle">{escape(x_label)}</text>',
            f'<text transform="translate(18,{TOP + (HEIGHT - TOP - BOTTOM) / 2}) rotate(-90)" {FONT} '
            f'font-size="12" text-anchor="middle">{escape(y_label)}</text>']


def _grid(out: list[str], x: _Axis | None, y: _Axis, x_names: Sequence[tuple[float, str]] = ()) -> None:
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    for t in y.ticks:
        py = y.at(t)
        out.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{x1}" y2="{py:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{py + 4:.1f}" {FONT} font-size="11" text-anchor="end">{_fmt(t)}</text>')
    if x is not None:
        for t, name in x_names or [(t, _fmt(t)) for t in x.ticks]:
            px = x.at(t)
            out.append(f'<line x1="{px:.1f}" y1="{y0}" x2="{px:.1f}" y2="{y1}" stroke="#eee"/>')
            out.append(f'<text x="{px:.1f}" y="{y0 + 16}" {FONT} font-size="11" text-anchor="middle">{escape(name)}</text>')
    out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#333"/>')


def _legend(out: list[str], entries: Sequence[tuple[str, str, bool]]) -> None:
    x = WIDTH - RIGHT + 14
    for i, (label, color, dashed) in enumerate(entries):
        y = TOP + 8 + 18 * i
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 26}" y2="{y}" stroke="{color}" stroke-width="2.5"{dash}/>')
        out.append(f'<text x="{x + 32}" y="{y + 4}" {FONT} font-size="11">{escape(label)}</text>')


def line_chart(title: str, x_label: str, y_label: str, series: Sequence[Series], *, log_x: bool = True,
               log_y: bool = False, x_names: Sequence[tuple[float, str]] = ()) -> str:
    """Lines with a marker at every point; an empty `series` gives a chart saying so."""
    out = _frame(title, x_label, y_label)
    pts = [p for s in series for p in s.points if not log_y or p[1] > 0]
    if not pts:
        out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" {FONT} font-size="13" text-anchor="middle">'
                   'nothing was measured</text></svg>')
        return "\n".join(out) + "\n"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x = _Axis(min(xs), max(xs), log_x, (LEFT + 20, WIDTH - RIGHT - 20))
    y = _Axis(min(ys), max(ys) * (1.0 if log_y else 1.1), log_y, (HEIGHT - BOTTOM, TOP))
    _grid(out, x, y, x_names)
    for s in series:
        shown = [(a, b) for a, b in s.points if not log_y or b > 0]
        if not shown:
            continue
        path = " ".join(f"{x.at(a):.1f},{y.at(b):.1f}" for a, b in shown)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2.5"{dash}/>')
        for a, b in shown:
            out.append(f'<circle cx="{x.at(a):.1f}" cy="{y.at(b):.1f}" r="3.5" fill="{s.color}" '
                       f'data-series="{escape(s.label)}" data-x="{a:g}" data-y="{b:g}">'
                       f'<title>{escape(s.label)}: {_fmt(a)} -> {b:g}</title></circle>')
    _legend(out, [(s.label, s.color, s.dashed) for s in series])
    out.append("</svg>")
    return "\n".join(out) + "\n"


def bar_chart(title: str, y_label: str, groups: Sequence[tuple[str, Sequence[Bar]]], *,
              reference: float | None = None, reference_label: str = "",
              legend: Sequence[tuple[str, str]] = ()) -> str:
    """Groups of bars side by side (one group per mode), with an optional horizontal line and
    a legend of (label, color)."""
    out = _frame(title, "", y_label)
    values = [b.value for _, bars in groups for b in bars]
    if not values:
        out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" {FONT} font-size="13" text-anchor="middle">'
                   'nothing was measured</text></svg>')
        return "\n".join(out) + "\n"
    y = _Axis(0.0, max(values + ([reference] if reference is not None else [])) * 1.15, False, (HEIGHT - BOTTOM, TOP))
    _grid(out, None, y)
    span = (WIDTH - RIGHT - LEFT) / len(groups)
    for gi, (name, bars) in enumerate(groups):
        gx = LEFT + gi * span
        w = (span * 0.8) / max(1, len(bars))
        for bi, b in enumerate(bars):
            bx, by = gx + span * 0.1 + bi * w, y.at(b.value)
            out.append(f'<rect x="{bx:.1f}" y="{by:.1f}" width="{w * 0.9:.1f}" height="{HEIGHT - BOTTOM - by:.1f}" '
                       f'fill="{b.color}" data-group="{escape(name)}" data-bar="{escape(b.label)}" '
                       f'data-value="{b.value:g}"><title>{escape(name)}, {escape(b.label)}: {b.value:g}</title></rect>')
        out.append(f'<text x="{gx + span / 2:.1f}" y="{HEIGHT - BOTTOM + 16}" {FONT} font-size="11" '
                   f'text-anchor="middle">{escape(name)}</text>')
    if reference is not None:
        ry = y.at(reference)
        out.append(f'<line x1="{LEFT}" y1="{ry:.1f}" x2="{WIDTH - RIGHT}" y2="{ry:.1f}" stroke="#333" '
                   'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{LEFT + 6}" y="{ry - 5:.1f}" {FONT} font-size="11">{escape(reference_label)}</text>')
    for i, (label, color) in enumerate(legend):
        ly = TOP + 30 + 18 * i
        out.append(f'<rect x="{WIDTH - RIGHT + 14}" y="{ly - 8}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 32}" y="{ly + 2}" {FONT} font-size="11">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
