"""The repository explains itself: everything the code and tests cite is in docs/.

Over the text files of usproxy/, tests/, bench/, scripts/, demo/, docs/ and README.md:
- nothing cites the design notes that were kept outside the repository, in a `shared` directory
  beside it (OUTSIDE lists their names);
- every field-case number cited ("C03" in text, `test_c03_...` in a test's name) is defined by a
  `## Cnn: ...` heading of docs/field-cases.md;
- every `docs/<name>.md` or `docs/<name>.md#<section>` cited exists, with that section.
And within docs/: every relative link resolves (file and section), every repository path a page
names exists, and every test function it names in backquotes is defined under tests/.
Pure file reading; no root needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("usproxy", "tests", "bench", "scripts", "demo", "docs", "README.md")

# Spelled in pieces so that this file does not cite them itself.
OUTSIDE = re.compile("|".join((
    r"\.\./" + "shared", r"/work/" + "shared",
    r"\bPLAT" + r"FORM\b", r"\bFIELD" + r"_CASES\b", r"\bDES" + r"IGN\b", r"\bSTY" + r"LE\.md\b",
)))
CASE_CITED = re.compile(r"\bC(\d\d)\b|\btest_c(\d\d)_")
CASE_DEFINED = re.compile(r"^## C(\d\d): ", re.MULTILINE)
DOC_CITED = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.MULTILINE)
MD_LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:usproxy|tests|bench|demo|scripts|examples)/[\w./-]*\w)")
TEST_NAME = re.compile(r"`(test_\w+)`")


def text_files() -> Iterator[tuple[str, str]]:
    """(path relative to the repository, text) of every scanned file that is UTF-8 text."""
    for top in SCANNED:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:  # PNG charts, compiled BPF objects
                continue
            yield str(path.relative_to(ROOT)), text


def slug(heading: str) -> str:
    """A heading's anchor as GitHub forms it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(page.read_text(encoding="utf-8"))}


def defined_cases() -> set[str]:
    return set(CASE_DEFINED.findall((DOCS / "field-cases.md").read_text(encoding="utf-8")))


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


FILES = list(text_files())


def test_the_scan_sees_the_tree() -> None:
    names = {name for name, _ in FILES}
    assert {"README.md", "usproxy/core/proxier.py", "tests/test_docs.py", "docs/field-cases.md"} <= names


def test_nothing_cites_documents_outside_the_repository() -> None:
    found = [f"{name}:{line_of(text, m.start())}: {m.group()}"
             for name, text in FILES for m in OUTSIDE.finditer(text)]
    assert found == [], "cite docs/ instead:\n" + "\n".join(found)


def test_every_cited_field_case_is_defined() -> None:
    defined = defined_cases()
    assert len(defined) >= 10, "docs/field-cases.md defines no cases under '## Cnn: ' headings"
    found = []
    for name, text in FILES:
        cites = [(f"{name} (its name)", m) for m in CASE_CITED.finditer(Path(name).name)]
        cites += [(f"{name}:{line_of(text, m.start())}", m) for m in CASE_CITED.finditer(text)]
        found += [f"{where}: C{m.group(1) or m.group(2)}" for where, m in cites
                  if (m.group(1) or m.group(2)) not in defined]
    assert found == [], "not defined in docs/field-cases.md:\n" + "\n".join(found)


def test_every_cited_document_and_section_exists() -> None:
    found = []
    for name, text in FILES:
        for m in DOC_CITED.finditer(text):
            page, section = DOCS / m.group(1), m.group(2)
            if not page.is_file() or (section and section not in sections(page)):
                found.append(f"{name}:{line_of(text, m.start())}: {m.group()}")
    assert found == [], "no such document or section in docs/:\n" + "\n".join(found)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_links_paths_and_test_names_in_docs_resolve(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    broken = []
    for m in MD_LINK.finditer(text):
        target = (DOCS / m.group(1)).resolve() if m.group(1) else DOCS / page
        if not target.exists() or (m.group(2) and target.suffix == ".md" and m.group(2) not in sections(target)):
            broken.append(f"link {m.group()}")
    broken += [f"path {p}" for p in REPO_PATH.findall(text) if not (ROOT / p).exists()]
    defined_tests = {n for _, t in FILES for n in re.findall(r"def (test_\w+)", t)}
    broken += [f"test {n}" for n in TEST_NAME.findall(text) if n not in defined_tests]
    assert broken == [], f"docs/{page}:\n" + "\n".join(broken)


def test_field_case_headings_are_unique_and_ordered() -> None:
    numbers = CASE_DEFINED.findall((DOCS / "field-cases.md").read_text(encoding="utf-8"))
    assert numbers == sorted(set(numbers))
