"""The pages' shared sections (usproxy/explain/page_sections.py) as `explain --html` writes them:
the introduction first, "why, in numbers" measured on the Services (and on more generated like
them), a tour's plots with their captions, and the flags that ask for them."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

import pytest

from usproxy.explain import cli, page_sections, registry, scale, standalone_page
from usproxy.model.service_set import load_manifests, service_set

EXAMPLES = Path(__file__).parents[2] / "examples"


def examples_page(**kw: object) -> str:
    return standalone_page.render(service_set(load_manifests(EXAMPLES)), **kw)  # type: ignore[arg-type]


def tables(page: str) -> list[dict[str, list[str]]]:
    """Each "why, in numbers" table: mode -> the rest of its row, cells unescaped."""
    out = []
    for body in re.findall(r'<table class="numbers">.*?<tbody>(.*?)</tbody>', page, re.S):
        rows = [[unescape(c) for c in re.findall(r"<td>(.*?)</td>", r)] for r in re.findall(r"<tr>(.*?)</tr>", body)]
        out.append({r[0]: r[1:] for r in rows})
    return out


def test_the_page_opens_with_an_introduction_to_services_and_every_mode() -> None:
    page = examples_page()
    intro = page[page.index('<section class="intro">'):page.index("</section>")]
    assert page.index('<section class="intro">') < page.index('<details class="service"')
    assert "<b>Service</b> is a stable address" in intro and "<b>endpoints</b>" in intro
    for mode in registry.MODES:  # each mode introduced by its record's own sentence
        assert f"<li><b>{mode.name}</b>: {mode.gist}</li>".replace("'", "&#x27;") in intro, mode.name
    assert "<b>drawing</b>" in intro and "<b>rules</b>" in intro and "dashed line is the reply" in intro


def test_why_in_numbers_is_measured_on_the_services_and_at_scale() -> None:
    """The page's first table is --scale's measurement of examples/ itself, the second of 40
    Services generated like them: iptables' walk grows with the Services, the maps' does not."""
    ss = service_set(load_manifests(EXAMPLES))
    page = standalone_page.render(ss, generated=40)
    own, big = tables(page)
    assert list(own) == list(registry.NAMES) == list(big)
    for mode in registry.MODES:  # the cells are the measurement's own
        m = scale.measure(ss, mode, lambda s, md: md.view(s, "dump"))
        assert own[mode.name][:2] == scale.row(m)[1:3], mode.name
    assert int(big["iptables"][0]) > int(own["iptables"][0])  # a list, walked to the last Service
    for name in ("nftables", "bpf"):  # map lookups: as many at 40 Services as at 4
        assert big[name][:2] == own[name][:2], name


def test_a_tours_plots_are_shown_with_their_captions(tmp_path: Path) -> None:
    (tmp_path / "match-cost.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    (tmp_path / "uniformity.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "results.json").write_text(json.dumps(
        {"plots": [{"file": "match-cost.svg", "caption": "new connections per second by Services"}]}))
    html = page_sections.tour_html(tmp_path)
    assert html is not None
    assert re.findall(r'alt="([^"]+)" src="data:image/(svg\+xml|png);base64,', html) == [
        ("match-cost.svg", "svg+xml"), ("uniformity.png", "png")]
    assert "<figcaption>new connections per second by Services</figcaption>" in html
    assert "<figcaption>uniformity.png</figcaption>" in html  # no caption given: its name
    assert html in examples_page(tour=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert page_sections.tour_html(empty) is None and 'class="tour"' not in examples_page(tour=empty)


def test_tour_results_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plot.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    out = tmp_path / "page.html"
    assert cli.main(["--services", str(EXAMPLES), "--html", str(out), "--scale", "10",
                     "--tour-results", str(tmp_path)]) == 0
    assert 'alt="plot.svg"' in out.read_text() and "at 10 Services generated" in out.read_text()
    with pytest.raises(SystemExit) as usage:
        cli.main(["--services", str(EXAMPLES), "--tour-results", str(tmp_path)])
    assert usage.value.code == 2 and "--tour-results goes with --html" in capsys.readouterr().err
