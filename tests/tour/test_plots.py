"""The tour's plots say what results.json says: every point of every line and every bar is
read back from the SVG (its data- attributes) and compared with the ModeResults it was drawn
from; a mode that did not run has no line; each plot has one caption that states the plan; the
web view's and explain --html's reader (page_sections.tour_html) shows them with those captions,
in results.json's order."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from usproxy.explain.page_sections import tour_html
from usproxy.tour import plots, results
from usproxy.tour.results import MatchCost, ModeResult, UpdateCost, Uniformity
from usproxy.tour.runner import QUICK

SVG = "{http://www.w3.org/2000/svg}"
EPS = ("10.244.1.1", "10.244.1.2", "10.244.1.3", "10.244.1.4", "10.244.1.5")


def mode(name: str, rate: float, p50: float, writes: int | None, counts: tuple[int, ...]) -> ModeResult:
    r = ModeResult(name, name, True, "probe says yes", name)
    for n in (10, 1000):
        for pos, slower in (("first", 1.0), ("last", n / 10)):
            r.match.append(MatchCost(n, pos, f"tour/x:{pos}", None, rate / slower, 16, 100, 0, p50 * slower,  # type: ignore[arg-type]
                                     p50 * slower * 3, 100, 0))
        r.update.append(UpdateCost(n, (0.01 * n, 0.02 * n), 0.015 * n, None if writes is None else (writes * n,) * 2,
                                   None if writes is None else f"{name} units", (1, 1), (0.001 * n,), 0.001 * n))
    r.uniformity = Uniformity(10, EPS, counts, counts, sum(counts), 0, 1.5, 4, 0.83)
    return r


def points(svg: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for c in ET.fromstring(svg).iter(f"{SVG}circle"):
        out.setdefault(c.attrib["data-series"], []).append((float(c.attrib["data-x"]), float(c.attrib["data-y"])))
    return out


def test_every_plotted_value_is_a_result(tmp_path: Path) -> None:
    modes = [mode("iptables", 5000, 100, 38, (2000, 1990, 2010, 2000, 2000)),
             mode("relay", 2000, 300, None, (1980, 2020, 2000, 2000, 2000)),
             ModeResult("ipvs", "ipvs", False, "the kernel lacks it")]
    figures = plots.write_all(tmp_path, modes, QUICK)
    assert [f.file for f in figures] == ["match-rate.svg", "match-latency-p50.svg", "match-latency-p99.svg",
                                        "update-time.svg", "update-writes.svg", "uniformity.svg"]
    rate = points((tmp_path / "match-rate.svg").read_text())
    assert set(rate) == {"iptables, last", "iptables, first", "relay, last", "relay, first"}  # no ipvs
    for r in modes[:2]:
        for c in r.match:
            assert (c.services, c.conns_per_s) in rate[f"{r.mode}, {c.position}"]
            assert (c.services, c.latency_p50_us) in points((tmp_path / "match-latency-p50.svg").read_text())[
                f"{r.mode}, {c.position}"]
            assert (c.services, c.latency_p99_us) in points((tmp_path / "match-latency-p99.svg").read_text())[
                f"{r.mode}, {c.position}"]
    times = points((tmp_path / "update-time.svg").read_text())
    assert times["iptables"] == [(10, 150.0), (1000, 15000.0)] and times["relay, sync"] == [(10, 10.0), (1000, 1000.0)]
    writes = points((tmp_path / "update-writes.svg").read_text())
    assert writes == {"iptables": [(10, 380.0), (1000, 38000.0)]}  # the relay counts nothing
    bars = [(b.attrib["data-group"], b.attrib["data-bar"], float(b.attrib["data-value"]))
            for b in ET.fromstring((tmp_path / "uniformity.svg").read_text()).iter(f"{SVG}rect") if "data-bar" in b.attrib]
    assert bars[:2] == [("iptables (p=0.83)", EPS[0], 20.0), ("iptables (p=0.83)", EPS[1], 19.9)]
    assert len(bars) == 10


def test_captions_state_the_plan_and_the_pages_show_them(tmp_path: Path) -> None:
    modes = [mode("nftables", 6000, 100, 4, (2000,) * 5)]
    figures = plots.write_all(tmp_path, modes, QUICK)
    results.write(tmp_path, results.document({"plan": {}}, modes, figures))
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [p["file"] for p in doc["plots"]] == [f.file for f in figures]
    assert "best of 3 windows of 0.3 s" in figures[0].caption and "16 short connections" in figures[0].caption
    assert "over 300 connections" in figures[1].caption
    for f in figures:
        assert f.caption.count(". ") == 0 and f.caption.endswith(".")  # one sentence
    (tmp_path / "a-later-plot.svg").write_text((tmp_path / "uniformity.svg").read_text())
    html = tour_html(tmp_path)
    assert html is not None and all(f.caption.replace("'", "&#x27;") in html for f in figures)
    shown = [html.index(f'alt="{f.file}"') for f in figures] + [html.index('alt="a-later-plot.svg"')]
    assert shown == sorted(shown)  # in results.json's order, a plot it does not list after them


def test_a_tour_that_measured_nothing_draws_empty_charts_saying_so(tmp_path: Path) -> None:
    figures = plots.write_all(tmp_path, [ModeResult("ipvs", "ipvs", False, "no")], QUICK)
    for f in figures:
        assert "nothing was measured" in (tmp_path / f.file).read_text()
