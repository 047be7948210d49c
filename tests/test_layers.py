"""The package imports point down the layers docs/architecture.md draws, and that page gives every
module of usproxy/ its place.

The layer drawing is read from docs/architecture.md's "Layers" section (a package's row is the
line it is drawn on); every `import usproxy.X` and `from usproxy.X import` of every module, lazy
ones inside functions included, must name a package drawn on a lower row than the importer's, or
the importer's own package. "Where things are" must name, in its package's bullet, each module of
that package, and name no module that does not exist. Pure file reading; no root needed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "usproxy"
PAGE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = PAGE.index(f"## {title}\n")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end >= 0 else len(PAGE)]


def rows() -> dict[str, int]:
    """Top-level package -> the row of the layer drawing it is drawn on."""
    drawing = section("Layers").split("```")[1]
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    out: dict[str, int] = {}
    for row, line in enumerate(drawing.splitlines()):
        for name in re.findall(r"(?<![\w/])(\w+)/", line):
            if name in packages and name not in out:
                out[name] = row
    return out


def package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0]


def imported_packages(path: Path) -> set[str]:
    """The top-level usproxy packages `path` imports, anywhere in the module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = (name or "").split(".")
            if parts[0] == "usproxy" and len(parts) > 1:
                out.add(parts[1])
    return out


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if len(p.relative_to(PACKAGE).parts) > 1)


def test_the_drawing_holds_every_package() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert set(rows()) == packages


def test_every_import_points_down_the_layers() -> None:
    row = rows()
    upward = [f"{path.relative_to(ROOT)} imports usproxy.{dst}"
              for path in modules() for dst in sorted(imported_packages(path))
              if dst in row and dst != package_of(path) and row[dst] <= row[package_of(path)]]
    assert upward == []


def bullets() -> dict[str, str]:
    """Package path ("offload/bpf") -> the text of its bullet under "Where things are"."""
    text = section("Where things are")
    found = re.findall(r"^- \*\*([\w/]+)/\*\*(.*?)(?=^- \*\*|\Z)", text, re.M | re.S)
    return {name: body for name, body in found}


def test_every_module_has_its_place_and_every_module_named_exists() -> None:
    by_package: dict[str, set[str]] = {}
    for path in modules():
        rel = path.relative_to(PACKAGE)
        if rel.name != "__init__.py":
            by_package.setdefault("/".join(rel.parts[:-1]), set()).add(rel.stem)
    places = bullets()
    assert set(places) == set(by_package)
    for package, names in by_package.items():
        named = set(re.findall(r"`(\w+)`", places[package]))
        assert names - named == set(), f"{package}: modules without a place in docs/architecture.md"
        assert {n for n in named if n.islower()} - names == set(), f"{package}: named modules that do not exist"
